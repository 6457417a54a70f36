"""Hostile input to the stores: any URL, any value under an entry's key, any reply a server can send, anything
planted at an entry's path. A store answers StoreError (URLs only), a miss or False; never another exception,
never a hang."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtc.errors import StoreError
from kvtc.store import FileStore, RedisStore, Store, open_store, seal
from redis_server import redis_cluster, redis_server, redis_url, whole_cluster_url  # noqa: F401  (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
import fuzz_store  # noqa: E402  (the store fuzz campaign's inputs)

NS = "model:calibration"
FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]

# -- URLs ------------------------------------------------------------------------------------

# the URL parts the store fuzz campaign draws from (fuzz/fuzz_store.py), here as hypothesis strategies
OPTION_NAMES = fuzz_store.OPTION_NAMES
NUMBERS = st.one_of(
    st.sampled_from(fuzz_store.NUMBERS),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.text(max_size=12),
)
QUERY = st.lists(st.tuples(st.sampled_from(OPTION_NAMES), NUMBERS), max_size=4).map(
    lambda pairs: "&".join(f"{k}={v}" for k, v in pairs)
)
NETLOC = st.one_of(st.sampled_from(fuzz_store.NETLOCS), st.text(max_size=20))


def _check(url: str) -> Store | None:
    try:
        store = open_store(url, NS)
    except StoreError:
        return None
    assert isinstance(store, Store)
    return store


@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURES)
@given(
    scheme=st.sampled_from(
        ["memory", "redis", "rediss", "redis+cluster", "rediss+cluster", "REDIS", "ftp", "valkey", "s3"]
    ),
    netloc=NETLOC,
    path=st.one_of(st.sampled_from(["", "/", "/0", "/3", "/x", "/-1", "/99999999999", "/0/1"]), st.text(max_size=10)),
    query=QUERY,
    tail=st.sampled_from(["", "#frag", "?", "?&", "?a", "?=1"]),
)
def test_any_url_opens_a_store_or_raises_store_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, scheme: str, netloc: str, path: str, query: str, tail: str
) -> None:
    monkeypatch.chdir(tmp_path)  # a URL read as a plain path would make its directory here
    store = _check(f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "") + tail)
    if store is not None:  # opening connects to nothing: Redis stores connect on first use
        store.close()


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURES)
@given(name=st.text(min_size=1, max_size=20).filter(lambda n: "/" not in n and n not in (".", "..")), query=QUERY)
def test_file_urls(tmp_path: Path, name: str, query: str) -> None:
    store = _check(f"file://{tmp_path}/{name}" + (f"?{query}" if query else ""))
    if store is not None:
        assert store.put("k", b"v") and store.get("k") == b"v"


@pytest.mark.redis
@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURES)
@given(query=QUERY)
def test_redis_options_never_break_get_and_put(redis_url: str, query: str) -> None:  # noqa: F811
    store = _check(redis_url + (f"?{query}" if query else ""))
    if store is not None:
        ok = store.put("k", b"v")
        assert store.get("k") in (None, b"v") and store.get_many(["k", "j"])["j"] is None
        assert isinstance(ok, bool) and isinstance(store.contains("k"), bool) and isinstance(store.delete("k"), bool)
        store.close()


# -- whatever a real server holds under an entry's key ---------------------------------------

RAW_VALUES = st.one_of(
    st.tuples(st.just("string"), st.binary(max_size=300)),
    st.tuples(st.just("string"), st.binary(max_size=60).map(lambda b: b"KVTS\x01\x00" + b)),
    st.tuples(
        st.just("string"),
        st.sampled_from(
            [
                seal(NS, "other", b"x"),
                seal("other:ns", "k0", b"x"),
                seal(NS, "k0", b"x")[:-1],
                seal(NS, "k0", b"x") + b"\x00",
            ]
        ),
    ),
    st.tuples(st.sampled_from(["list", "hash", "set", "zset", "stream", "int"]), st.binary(min_size=1, max_size=20)),
)


def _plant(client, name: str, kind: str, data: bytes) -> None:
    client.delete(name)
    if kind == "string":
        client.set(name, data)
    elif kind == "list":
        client.rpush(name, data)
    elif kind == "hash":
        client.hset(name, data, data)
    elif kind == "set":
        client.sadd(name, data)
    elif kind == "zset":
        client.zadd(name, {data: 1.5})
    elif kind == "stream":
        client.xadd(name, {data: data})
    else:
        client.set(name, 12345)
        client.incr(name)


@pytest.fixture(params=["redis", "redis-cluster"])
def planted(request: pytest.FixtureRequest) -> tuple[str, Callable[[str, str, bytes], None]]:
    """(store URL, plant(name, kind, data)) on a real server or cluster."""
    import redis

    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        client = redis.Redis.from_url(url)
        return url, lambda name, kind, data: _plant(client, name, kind, data)
    cluster = request.getfixturevalue("redis_cluster")
    url = whole_cluster_url(cluster)

    def plant(name: str, kind: str, data: bytes) -> None:
        with cluster.client(cluster.owner(name.encode())) as c:
            _plant(c, name, kind, data)

    return url, plant


@pytest.mark.redis
@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURES)
@given(values=st.lists(RAW_VALUES, min_size=1, max_size=5))
def test_whatever_a_key_holds_is_a_miss(
    planted, values: list[tuple[str, bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    url, plant = planted
    store = open_store(url, NS)
    keys = [f"k{i}" for i in range(len(values))]
    assert isinstance(store, RedisStore)
    for key, (kind, data) in zip(keys, values):
        plant(store.redis_key(key), kind, data)
    with caplog.at_level(logging.WARNING, logger="kvtc.store"):
        assert store.get_many(keys) == dict.fromkeys(keys)
        assert all(store.get(k) is None for k in keys)
        assert all(isinstance(store.contains(k), bool) for k in keys)
    assert store.stats()["hits"] == 0
    assert store.put_many({k: b"good" for k in keys}) == dict.fromkeys(keys, True)  # SET replaces any type
    assert store.get_many(keys) == dict.fromkeys(keys, b"good")


# -- a server that answers anything ----------------------------------------------------------


HostileServer = fuzz_store.HostileServer  # the campaign's server: answers each command with the next reply


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileServer]:
    server = HostileServer()
    yield server
    server.close()


_resp, _line = fuzz_store._resp, fuzz_store._line


LEAF = st.one_of(
    st.binary(max_size=30).map(lambda b: b"+" + _line(b) + b"\r\n"),
    st.binary(max_size=30).map(lambda b: b"-" + _line(b) + b"\r\n"),
    st.sampled_from(fuzz_store.FIXED_LEAVES),
    st.integers(min_value=-(2**70), max_value=2**70).map(lambda i: b":%d\r\n" % i),
    st.binary(max_size=120).map(lambda b: b"$%d\r\n%s\r\n" % (len(b), b)),
    st.sampled_from([seal(NS, "k0", b"payload"), seal(NS, "other", b"payload")]).map(
        lambda b: b"$%d\r\n%s\r\n" % (len(b), b)
    ),
    st.binary(max_size=12),  # not RESP at all
)
TREE = st.recursive(LEAF, lambda children: st.lists(children, max_size=4).map(_resp), max_leaves=16)
DEEP = st.tuples(st.integers(1, 5000), LEAF).map(lambda t: b"*1\r\n" * t[0] + t[1])
REPLIES = st.lists(st.one_of(TREE, DEEP), min_size=1, max_size=3)


def _slot_replies(port: int) -> st.SearchStrategy[bytes]:
    """CLUSTER SLOTS answers: the right one (every slot on this server) and malformed ones. Hosts are loopback
    or unusable, so that nothing here ever reaches another machine."""
    here = b"$9\r\n127.0.0.1\r\n:%d\r\n" % port
    good = b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n" + here
    hosts = st.sampled_from(
        [
            b"$0\r\n\r\n",
            b"$1\r\n?\r\n",
            b"$9\r\n127.0.0.1\r\n",
            b"$2\r\n\xff\xfe\r\n",
            b"$4\r\na b\x00\r\n",
            b":1\r\n",
            b"*0\r\n",
        ]
    )
    ports = st.sampled_from([b":%d\r\n" % port, b":0\r\n", b":-1\r\n", b":70000\r\n", b"$4\r\n6379\r\n", b"$-1\r\n"])
    slot = st.sampled_from([b":0\r\n", b":16383\r\n", b":16384\r\n", b":-1\r\n", b"$1\r\n0\r\n", b"*0\r\n"])
    node = st.tuples(hosts, ports).map(lambda hp: b"*2\r\n" + hp[0] + hp[1])
    entry = st.tuples(slot, slot, node).map(lambda t: b"*3\r\n" + b"".join(t))
    garbage = st.sampled_from(
        [
            b"*1\r\n" * 5000 + b":1\r\n",
            b"-ERR This instance has cluster support disabled\r\n",
            b"$-1\r\n",
            b":1\r\n",
            b"*1\r\n:1\r\n",
            b"$3\r\nabc\r\n",
            b"nonsense",
        ]
    )
    return st.one_of(st.just(good), st.lists(entry, max_size=3).map(_resp), garbage)


@given(data=st.data(), replies=REPLIES, scheme=st.sampled_from(["redis", "redis+cluster"]))
@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURES)
def test_any_reply_is_a_miss_never_an_exception(
    hostile: HostileServer, data, replies: list[bytes], scheme: str
) -> None:
    hostile.replies = replies
    hostile.slots = data.draw(_slot_replies(hostile.port))
    store = open_store(f"{scheme}://127.0.0.1:{hostile.port}?timeout=0.05&retry_interval=0", NS)
    try:
        t0 = time.monotonic()
        assert store.get("k0") in (None, b"payload")
        assert isinstance(store.put("k0", b"v"), bool)
        got = store.get_many(["k0", "k1", "k2"])
        assert set(got) == {"k0", "k1", "k2"} and got["k1"] is None and got["k2"] is None
        assert set(store.put_many({"a": b"1", "b": b"2"})) == {"a", "b"}
        assert isinstance(store.contains("k0"), bool) and isinstance(store.delete("k0"), bool)
        assert isinstance(store.clear(), int)
        assert time.monotonic() - t0 < 10
    finally:
        store.close()


def test_absurdly_nested_reply(hostile: HostileServer, caplog: pytest.LogCaptureFixture) -> None:
    hostile.replies = [b"*1\r\n" * 100_000 + b":1\r\n"]
    store = open_store(f"redis://127.0.0.1:{hostile.port}?timeout=1&retry_interval=0", NS)
    with caplog.at_level(logging.WARNING, logger="kvtc.store"):
        assert store.get("k") is None and store.put("k", b"v") is False
    assert "nested deeper than" in caplog.text and store.stats()["errors"] == 2


# -- files -----------------------------------------------------------------------------------


def _in_thread(fn: Callable[[], object], timeout: float = 5.0) -> object:
    box: list[object] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert box, "the store blocked"
    return box[0]


@pytest.mark.parametrize("plant", ["fifo", "symlink", "directory", "device"])
def test_non_regular_entry_path_is_a_miss(tmp_path: Path, plant: str, caplog: pytest.LogCaptureFixture) -> None:
    store = FileStore(tmp_path / "store", NS)
    assert store.put("neighbour", b"fine")
    path = store.path_of("victim")
    path.parent.mkdir(parents=True, exist_ok=True)
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "symlink":
        (tmp_path / "outside").write_bytes(seal(NS, "victim", b"from outside the store"))
        path.symlink_to(tmp_path / "outside")
    elif plant == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    with caplog.at_level(logging.WARNING, logger="kvtc.store"):
        assert _in_thread(lambda: store.get("victim")) is None
    assert "not a regular file" in caplog.text or "cannot" in caplog.text
    assert store.get("neighbour") == b"fine" and _in_thread(lambda: store.stats())["hits"] == 1
    if plant != "directory":  # removed like a corrupt entry; a directory cannot be, and stays a miss
        assert not os.path.lexists(path) and store.put("victim", b"mine") and store.get("victim") == b"mine"
    assert (tmp_path / "outside").exists() or plant != "symlink"


def test_fifo_lock_file_does_not_block_stats(tmp_path: Path) -> None:
    store = FileStore(tmp_path, NS)
    os.unlink(tmp_path / ".kvtc-store")
    os.mkfifo(tmp_path / ".kvtc-store")
    assert isinstance(_in_thread(store.stats), dict)
