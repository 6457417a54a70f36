"""Stores: round trips, envelope, LRU budgets, corruption, identity, failures, Redis outage, concurrency."""

from __future__ import annotations

import hashlib
import logging
import os
import resource
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtc.errors import FormatError, StoreError
from kvtc.store import FileStore, MemoryStore, RedisStore, Store, entry_id, open_store, seal, unseal
from kvtc.store.base import HEADER_SIZE, envelope_names
from redis_server import (  # noqa: F401  (pytest fixtures)
    RedisServer,
    own_redis_server,
    redis_cluster,
    redis_server,
    redis_url,
    valkey_cluster,
    whole_cluster_url,
)

NS_A = "HuggingFaceTB/SmolLM2-135M:calib-aaaa"
NS_B = "HuggingFaceTB/SmolLM2-135M:calib-bbbb"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.fixture(
    params=[
        "file",
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("redis-cluster", marks=pytest.mark.redis),
        pytest.param("valkey-cluster", marks=pytest.mark.redis),
    ]
)
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Store]]:
    """Opens stores of one kind (all sharing one backend) for a namespace; closes them afterwards.
    The cluster kinds are three masters in cluster mode (see tests/redis_server.py)."""
    if request.param == "redis":
        base = request.getfixturevalue("redis_url")
    elif request.param.endswith("-cluster"):
        base = whole_cluster_url(request.getfixturevalue(request.param.replace("-", "_")))
    elif request.param == "file":
        base = f"file://{tmp_path}/store"
    else:
        base = "memory://"
    opened: list[Store] = []

    def make(namespace: str = NS_A) -> Store:
        store = open_store(base, namespace)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


# -- every store -----------------------------------------------------------------------------


def test_round_trip(make_store: Callable[..., Store]) -> None:
    store = make_store()
    assert store.get("absent") is None and not store.contains("absent")
    assert store.put("chunk-0", b"\x00kv\xff" * 1000)
    assert store.get("chunk-0") == b"\x00kv\xff" * 1000 and store.contains("chunk-0")
    assert store.put("chunk-0", bytearray(b"replaced")) and store.get("chunk-0") == b"replaced"
    assert store.put("leer", b"") and store.get("leer") == b""
    assert store.put("ключ/🔑", memoryview(b"unicode key")) and store.get("ключ/🔑") == b"unicode key"
    assert store.delete("chunk-0") and not store.delete("chunk-0")
    assert store.get("chunk-0") is None and not store.contains("chunk-0")
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["puts"], stats["corrupt"], stats["errors"]) == (4, 2, 4, 0, 0)


def test_batch_ops(make_store: Callable[..., Store]) -> None:
    store = make_store()
    items = {f"k{i}": os.urandom(i * 100) for i in range(20)}
    assert store.put_many(items) == dict.fromkeys(items, True)
    got = store.get_many([*items, "missing"])
    assert got == {**items, "missing": None}
    assert store.put_many({}) == {} and store.get_many([]) == {}


def test_bad_arguments_are_rejected(make_store: Callable[..., Store]) -> None:
    store = make_store()
    with pytest.raises(TypeError, match="key"):
        store.put(b"bytes-key", b"v")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes-like"):
        store.put("k", "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key"):
        store.get("")


def test_namespaces_are_isolated(make_store: Callable[..., Store]) -> None:
    a, b = make_store(NS_A), make_store(NS_B)
    assert a.put("chunk-0", b"from A")
    assert b.get("chunk-0") is None
    assert b.put("chunk-0", b"from B")
    assert a.get("chunk-0") == b"from A" and b.get("chunk-0") == b"from B"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "delete", "contains"]),
            st.sampled_from(["a", "b", "c", "d"]),
            st.binary(max_size=64),
        ),
        max_size=30,
    )
)
def test_behaves_like_a_dict(make_store: Callable[..., Store], ops: list[tuple[str, str, bytes]]) -> None:
    store = make_store(f"model:{uuid.uuid4()}")  # a fresh namespace per example
    model: dict[str, bytes] = {}
    for op, key, value in ops:
        if op == "put":
            assert store.put(key, value)
            model[key] = value
        elif op == "get":
            assert store.get(key) == model.get(key)
        elif op == "delete":
            assert store.delete(key) == (model.pop(key, None) is not None)
        else:
            assert store.contains(key) == (key in model)


# -- envelope --------------------------------------------------------------------------------


def test_envelope_layout_is_fixed() -> None:
    blob = seal("m:c", "k1", b"payload")
    assert blob[:4] == b"KVTS" and blob[4] == 1 and blob[5] == 0
    assert int.from_bytes(blob[6:8], "little") == 3 and int.from_bytes(blob[8:10], "little") == 2
    assert int.from_bytes(blob[10:12], "little") == 0 and int.from_bytes(blob[12:20], "little") == 7
    digest = hashlib.blake2b(blob[:20] + b"m:c" + b"k1" + b"payload", digest_size=16, person=b"kvtc-store-v1")
    assert blob[20:36] == digest.digest()
    assert blob[36:] == b"m:ck1payload" and len(blob) == HEADER_SIZE + 12
    # A byte-exact fixture: changing the format must be deliberate (and bump the version).
    assert blob.hex() == (
        "4b56545301000300020000000700000000000000c9adf280b8761606564d4ae9b48124576d3a636b317061796c6f6164"
    )
    assert unseal("m:c", "k1", blob) == b"payload"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:-1], "torn"),
        (lambda b: b + b"x", "torn"),
        (lambda b: b[:10], "truncated"),
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:4] + b"\x02" + b[5:], "version"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
        (lambda b: b[:25] + bytes([b[25] ^ 0x80]) + b[26:], "checksum"),
    ],
)
def test_unseal_rejects_damage(mutate: Callable[[bytes], bytes], message: str) -> None:
    with pytest.raises(FormatError, match=message):
        unseal("m:c", "k1", mutate(seal("m:c", "k1", b"payload")))


def test_envelope_names_reads_what_seal_wrote_and_refuses_torn_entries() -> None:
    blob = seal(NS_A, "chunk-7", b"payload")
    assert envelope_names(blob) == (NS_A, "chunk-7")
    assert unseal(*envelope_names(blob), blob) == b"payload"
    for torn in (blob[:-1], blob[:10], b"XXXX" + blob[4:]):
        with pytest.raises(FormatError):
            envelope_names(torn)
    bad = bytearray(blob)
    bad[HEADER_SIZE] = 0xFF  # the namespace's first byte, no longer UTF-8
    with pytest.raises(FormatError, match="UTF-8"):
        envelope_names(bytes(bad))


def test_unseal_rejects_foreign_identity() -> None:
    blob = seal(NS_A, "chunk-0", b"A's bytes")
    with pytest.raises(FormatError, match="foreign"):
        unseal(NS_B, "chunk-0", blob)
    with pytest.raises(FormatError, match="foreign"):
        unseal(NS_A, "chunk-1", blob)
    # Namespace and key are length-delimited: moving the boundary changes the identity.
    assert entry_id("a:b", "c") != entry_id("a", "b:c")
    with pytest.raises(FormatError, match="foreign"):
        unseal("a", "b:c", seal("a:b", "c", b"x"))


# -- file store ------------------------------------------------------------------------------


def _entry_files(root: Path) -> list[Path]:
    return sorted(root.glob("??/??/*.kvs"))


def _temp_files(root: Path) -> list[Path]:
    return sorted(root.glob("??/??/.*.tmp"))


def test_file_layout_and_shared_usage(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS_A)
    for i in range(10):
        assert store.put(f"k{i}", os.urandom(1000 + i))
    path = store.path_of("k3")
    eid = entry_id(NS_A, "k3")
    assert path == tmp_path / eid[:2] / eid[2:4] / f"{eid}.kvs" and path.is_file()
    assert store.put("k3", b"short") and store.delete("k4")
    files = _entry_files(tmp_path)
    assert len(files) == 9 and not _temp_files(tmp_path)
    other = FileStore(tmp_path, NS_B)  # another handle (process) sees the same total
    assert store.stats()["bytes"] == other.stats()["bytes"] == sum(f.stat().st_size for f in files)


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_lru_evicts_least_recently_used(tmp_path: Path, kind: str) -> None:
    size = 1000
    entry = len(seal(NS_A, "k0", bytes(size))) if kind == "file" else size
    store: Store = (
        FileStore(tmp_path, NS_A, max_bytes=3 * entry, evict_to=1.0)
        if kind == "file"
        else MemoryStore(NS_A, max_bytes=3 * entry)
    )
    for key in ("k0", "k1", "k2"):
        assert store.put(key, bytes(size))
    assert store.get("k0") is not None  # k0 is now the most recent; k1 the least
    assert store.put("k3", bytes(size))
    assert [store.contains(k) for k in ("k0", "k1", "k2", "k3")] == [True, False, True, True]
    assert store.put("k4", bytes(size))
    assert [store.contains(k) for k in ("k0", "k2", "k3", "k4")] == [True, False, True, True]
    stats = store.stats()
    assert stats["evictions"] == 2 and stats["bytes"] == 3 * entry


def test_file_budget_holds_under_churn(tmp_path: Path) -> None:
    budget = 50_000
    store = FileStore(tmp_path, NS_A, max_bytes=budget)
    for i in range(200):
        assert store.put(f"k{i % 37}", os.urandom(500 + (i * 97) % 4000))
        held = sum(f.stat().st_size for f in _entry_files(tmp_path))
        assert held <= budget and store.stats()["bytes"] == held
    assert store.stats()["evictions"] > 0
    # The newest entry survives eviction even when it alone is over the evict_to target.
    assert store.put("big", bytes(budget - 200)) and store.get("big") == bytes(budget - 200)


def test_oversized_entry_is_refused_without_evicting(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for store in (FileStore(tmp_path, NS_A, max_bytes=10_000), MemoryStore(NS_A, max_bytes=10_000)):
        assert store.put("small", b"s" * 100)
        with caplog.at_level(logging.WARNING, logger="kvtc.store"):
            assert not store.put("huge", bytes(20_000))
        assert "exceeds" in caplog.text and store.get("small") == b"s" * 100 and not store.contains("huge")


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_bytes(p.read_bytes()[:-5]), id="truncated"),
        pytest.param(lambda p: p.write_bytes(p.read_bytes()[: HEADER_SIZE - 3]), id="truncated-header"),
        pytest.param(lambda p: p.write_bytes(b""), id="empty"),
        pytest.param(lambda p: p.write_bytes(p.read_bytes() + b"tail"), id="extended"),
        pytest.param(lambda p: _flip(p, -100), id="payload-bitflip"),
        pytest.param(lambda p: _flip(p, 15), id="length-field"),
        pytest.param(lambda p: p.write_bytes(os.urandom(5000)), id="garbage"),
    ],
)
def test_damaged_file_is_a_miss_and_removed(
    tmp_path: Path, damage: Callable[[Path], None], caplog: pytest.LogCaptureFixture
) -> None:
    store = FileStore(tmp_path, NS_A)
    assert store.put("victim", os.urandom(4000)) and store.put("bystander", b"fine")
    path = store.path_of("victim")
    damage(path)
    with caplog.at_level(logging.WARNING, logger="kvtc.store"):
        assert store.get("victim") is None
    assert not path.exists() and "bad entry" in caplog.text
    stats = store.stats()
    assert stats["corrupt"] == 1 and stats["misses"] == 1
    # Tampering changed a size behind the store's back; a sweep recounts from the files.
    assert store.sweep()["bytes"] == store.stats()["bytes"] == store.path_of("bystander").stat().st_size
    assert store.get("bystander") == b"fine"
    assert store.put("victim", b"again") and store.get("victim") == b"again"


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_entry_copied_across_namespaces_is_refused(tmp_path: Path) -> None:
    a, b = FileStore(tmp_path, NS_A), FileStore(tmp_path, NS_B)
    assert a.put("chunk-0", b"A's KV cache")
    target = b.path_of("chunk-0")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(a.path_of("chunk-0").read_bytes())
    assert b.contains("chunk-0")  # the file is there ...
    assert b.get("chunk-0") is None  # ... but it is A's, so B misses and removes it
    assert b.stats()["corrupt"] == 1 and not target.exists()
    assert a.get("chunk-0") == b"A's KV cache"
    # The same within a namespace: an entry moved to another key's file.
    target = a.path_of("chunk-1")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(a.path_of("chunk-0").read_bytes())
    assert a.get("chunk-1") is None and a.get("chunk-0") == b"A's KV cache"


def test_failed_write_keeps_existing_entries(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FileStore(tmp_path, NS_A)
    assert store.put("keep", b"old value")
    # A write that fails half-way (the file size limit stands in for a full disk).
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, old_limit[1]))
    try:
        with caplog.at_level(logging.WARNING, logger="kvtc.store"):
            ok = store.put("keep", os.urandom(1 << 20))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert not ok and "cannot write" in caplog.text
    assert store.get("keep") == b"old value" and not _temp_files(tmp_path)
    # A shard directory that cannot be created (a file in its place).
    blocked = store.path_of("blocked").parent
    blocked.parent.mkdir(parents=True, exist_ok=True)
    if blocked.exists():
        pytest.skip("shard already exists")
    blocked.write_bytes(b"")
    assert not store.put("blocked", b"v")
    assert store.stats()["errors"] == 2 and store.get("keep") == b"old value"


def test_unusable_root_raises_store_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreError, match="writable directory"):
        open_store(f"file://{tmp_path}/file/store", NS_A)


def test_sweep_removes_stale_temp_files_only(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS_A, tmp_grace=60)
    assert store.put("k", b"v")
    shard = store.path_of("k").parent
    stale, fresh = shard / f".{'0' * 32}.123.deadbeef.tmp", shard / f".{'1' * 32}.124.deadbeef.tmp"
    unrelated = shard / "notes.txt"
    for p in (stale, fresh, unrelated):
        p.write_bytes(b"partial")
    old = time.time() - 120
    os.utime(stale, (old, old))
    result = store.sweep()
    assert result["temp_removed"] == 1 and not stale.exists() and fresh.exists() and unrelated.exists()
    assert store.sweep(tmp_grace=0)["temp_removed"] == 1 and not fresh.exists()
    assert store.get("k") == b"v"


def test_threads_share_a_file_store(tmp_path: Path) -> None:
    from store_concurrency import make_value, value_ok

    store = FileStore(tmp_path, NS_A, max_bytes=200_000)
    bad: list[str] = []

    def hammer(t: int) -> None:
        for i in range(60):
            key = f"k{(i * 7 + t) % 11}"
            store.put(key, make_value(key, t, i, os.urandom(1000 + 37 * i)))
            got = store.get(f"k{(i + t) % 11}")
            if got is not None and not value_ok(f"k{(i + t) % 11}", got):
                bad.append(key)

    threads = [threading.Thread(target=hammer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and store.stats()["corrupt"] == 0
    assert store.sweep()["bytes"] == sum(f.stat().st_size for f in _entry_files(tmp_path)) <= 200_000


# -- URLs ------------------------------------------------------------------------------------


def test_open_store_urls(tmp_path: Path) -> None:
    f = open_store(f"file://{tmp_path}/a?max_bytes=64MiB&evict_to=0.5&tmp_grace=10&sweep_interval=5", NS_A)
    assert isinstance(f, FileStore) and f.max_bytes == 64 << 20 and f.evict_to == 0.5 and f.tmp_grace == 10
    assert isinstance(open_store(str(tmp_path / "b"), NS_A), FileStore)
    m = open_store("memory://?max_bytes=1k", NS_A)
    assert isinstance(m, MemoryStore) and m.max_bytes == 1000
    r = open_store("redis://u:p%40ss@10.0.0.1:7000/3?ttl=60&prefix=x:&timeout=0.1", NS_A)
    assert isinstance(r, RedisStore) and r.address == "10.0.0.1:7000/3" and r.ttl_ms == 60_000
    kwargs = r._node("10.0.0.1", 7000).client.connection_pool.connection_kwargs
    assert r.redis_key("k").startswith("x:") and kwargs["password"] == "p@ss" and kwargs["db"] == 3
    assert not r.cluster
    c = open_store("redis+cluster://a:7000,[::1]:7001,b?timeout=0.2", NS_A)
    assert isinstance(c, RedisStore) and c.cluster and c.address == "a:7000,::1:7001,b:6379"
    assert c.redis_key("k") == open_store("redis://a:7000", NS_A).redis_key("k")  # same keys as one server
    # Byte-exact: entries stored by earlier releases keep being found (changing this loses every stored entry).
    pinned = "kvtc:eafd3c56e03917cf:52a652504afb5748933c4c9d2e3b924f"
    assert open_store("redis+cluster://h", "m:c").redis_key("k1") == pinned
    for bad, message in [
        ("ftp://host/x", "unknown store URL scheme"),
        ("memory://?max_bytes=lots", "max_bytes"),
        ("memory://?budget=1", "unknown memory:// store option"),
        (f"file://{tmp_path}?evict_to=2", "evict_to"),
        ("file://otherhost/x", "names host"),
        ("redis://h:6379/zero", "integer"),
        ("redis://h/0?ttl=-1", "ttl"),
        ("redis://h/0?timeout=inf", "timeout"),
        ("redis://a:1,b:2/0", "redis\\+cluster://"),
        ("redis+cluster://a:1,b:2/3", "database 0"),
        ("redis://[::1/0", "malformed"),
        ("redis://h:0/0", "port"),
    ]:
        with pytest.raises(StoreError, match=message):
            open_store(bad, NS_A)


# -- Redis -----------------------------------------------------------------------------------


@pytest.mark.redis
def test_redis_keys_ttl_and_foreign_entries(redis_url: str) -> None:
    import redis

    raw = redis.Redis.from_url(redis_url)
    a = open_store(redis_url + "?ttl=30", NS_A)
    b = open_store(redis_url, NS_B)
    assert isinstance(a, RedisStore) and isinstance(b, RedisStore)
    assert a.put("chunk-0", b"A") and b.put("chunk-0", b"B")
    assert a.key_prefix != b.key_prefix and a.redis_key("chunk-0").startswith(a.key_prefix)
    assert 0 < raw.pttl(a.redis_key("chunk-0")) <= 30_000 and raw.pttl(b.redis_key("chunk-0")) == -1
    # Someone copies A's entry over B's key: B refuses it, counts it and deletes it.
    raw.set(b.redis_key("chunk-0"), raw.get(a.redis_key("chunk-0")))
    assert b.get("chunk-0") is None and b.stats()["corrupt"] == 1 and not raw.exists(b.redis_key("chunk-0"))
    raw.set(a.redis_key("chunk-1"), b"garbage")
    assert a.get_many(["chunk-0", "chunk-1"]) == {"chunk-0": b"A", "chunk-1": None}
    assert a.stats()["corrupt"] == 1 and not raw.exists(a.redis_key("chunk-1"))
    assert a.clear() == 1 and b.get("chunk-0") is None and raw.dbsize() == 0


@pytest.mark.redis
def test_redis_refused_write_is_false(redis_url: str) -> None:
    import redis

    raw = redis.Redis.from_url(redis_url)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", str(raw.info("memory")["used_memory"] + (1 << 20)))
    try:
        store = open_store(redis_url, NS_A)
        assert store.put("small", b"x")
        assert not store.put("big", bytes(4 << 20))
        assert store.get("small") == b"x" and store.stats()["errors"] == 1
    finally:
        raw.config_set("maxmemory", "0")


@pytest.mark.redis
def test_redis_outage_degrades_to_misses_and_recovers(
    own_redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,  # noqa: F811
) -> None:
    store = open_store(own_redis_server.url + "?retry_interval=0.2", NS_A)
    assert store.put("chunk-0", b"kv") and store.get("chunk-0") == b"kv"

    # An "engine" thread keeps using the store throughout; it must never see an exception.
    failures: list[BaseException] = []
    results: list[bytes | None] = []
    stop = threading.Event()

    def engine() -> None:
        i = 0
        while not stop.is_set():
            try:
                store.put(f"e{i % 5}", b"e")
                results.append(store.get(f"e{i % 5}"))
            except BaseException as e:  # noqa: BLE001
                failures.append(e)
            i += 1
            time.sleep(0.002)

    thread = threading.Thread(target=engine)
    with caplog.at_level(logging.WARNING, logger="kvtc.store"):
        thread.start()
        time.sleep(0.2)
        own_redis_server.stop()
        t0 = time.perf_counter()
        assert store.get("chunk-0") is None and not store.put("chunk-1", b"x")
        assert not store.contains("chunk-0") and not store.delete("chunk-0")
        assert store.get_many(["a", "b"]) == {"a": None, "b": None}
        assert time.perf_counter() - t0 < 1.0  # misses are fast, not timeouts
        time.sleep(0.5)
        warnings = [r for r in caplog.records if "serving misses" in r.getMessage()]
        assert len(warnings) == 1  # rate-limited: one warning for the whole outage
        own_redis_server.start()
        deadline = time.monotonic() + 5
        while not store.put("chunk-0", b"kv again") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.get("chunk-0") == b"kv again"
        time.sleep(0.2)
        stop.set()
        thread.join()
    assert not failures
    assert None in results and results[-1] == b"e"  # misses during the outage, hits after it
    assert store.stats()["errors"] > 0


# -- many processes --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", pytest.param("redis", marks=pytest.mark.redis)])
def test_eight_processes_never_read_corrupt_values(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    from store_concurrency import benchmark

    kwargs = {"file_root": str(tmp_path)} if kind == "file" else {"redis_url": request.getfixturevalue("redis_url")}
    (result,) = benchmark([kind], procs=8, seconds=5, keys=64, max_value=64 << 10, file_budget=2 << 20, **kwargs)
    assert result["corrupt_reads"] == 0 and result["store_corrupt"] == 0 and result["store_errors"] == 0
    assert result["puts"] > 100 and result["hits"] > 100 and result["put_failures"] == 0
    if kind == "file":
        assert result["store_evictions"] > 0
        assert sum(f.stat().st_size for f in _entry_files(tmp_path)) <= 2 << 20
