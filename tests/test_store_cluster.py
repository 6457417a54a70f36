"""The Redis store over a real 3-master cluster (redis-server and valkey-server): routing, TTL, redirects,
and a master killed under load (tests/redis_server.py starts the clusters)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvtc.store import RedisStore, open_store
from redis_server import LocalCluster, local_cluster, redis_cluster, valkey_cluster  # noqa: F401  (fixtures)

pytestmark = pytest.mark.redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

NS = "HuggingFaceTB/SmolLM2-135M:calib-cluster"


def _owners(cluster: LocalCluster, store: RedisStore, keys: list[str]) -> dict[str, int]:
    return {key: cluster.owner(store.redis_key(key).encode()) for key in keys}


def test_batches_cross_slots_and_spread_over_masters(local_cluster: LocalCluster) -> None:
    store = open_store(local_cluster.url, NS)
    assert isinstance(store, RedisStore) and store.cluster
    items = {f"chunk-{i}": os.urandom(100 + i) for i in range(60)}
    assert store.put_many(items) == dict.fromkeys(items, True)
    assert store.get_many([*items, "absent"]) == {**items, "absent": None}
    owners = _owners(local_cluster, store, list(items))
    for i in range(3):  # every master holds exactly the keys whose slots it serves
        with local_cluster.client(i) as c:
            held = {name.decode() for name in c.scan_iter(match=store.key_prefix + "*")}
        assert held == {store.redis_key(k) for k, o in owners.items() if o == i} and held
    assert store.clear() == 60 and store.get_many(list(items)) == dict.fromkeys(items)
    stats = store.stats()
    assert (stats["puts"], stats["hits"], stats["errors"], stats["corrupt"]) == (60, 60, 0, 0)


def test_ttl_and_bad_entries_on_the_owner(local_cluster: LocalCluster) -> None:
    store = open_store(local_cluster.url + "?ttl=30", NS)
    assert store.put_many({f"k{i}": b"v" for i in range(12)}) == {f"k{i}": True for i in range(12)}
    for key, owner in _owners(local_cluster, store, [f"k{i}" for i in range(12)]).items():
        with local_cluster.client(owner) as c:
            assert 0 < c.pttl(store.redis_key(key)) <= 30_000
            c.set(store.redis_key(key), b"not an envelope")
    assert store.get_many([f"k{i}" for i in range(12)]) == {f"k{i}": None for i in range(12)}
    assert store.stats()["corrupt"] == 12 and store.stats()["errors"] == 0
    assert not any(local_cluster.client(i).dbsize() for i in range(3))  # each removed on its own master


def test_plain_redis_url_detects_the_cluster(local_cluster: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(f"redis://127.0.0.1:{local_cluster.nodes[0].port}/0", NS)
    assert isinstance(store, RedisStore) and not store.cluster
    items = {f"chunk-{i}": bytes([i]) * 50 for i in range(30)}
    with caplog.at_level(logging.WARNING, logger="kvtc.store"):
        assert store.put_many(items) == dict.fromkeys(items, True)  # keys of other masters: MOVED, then routed
    assert store.cluster and "cluster node" in caplog.text
    assert store.get_many(list(items)) == items and store.stats()["errors"] == 0


def test_moved_slot_is_followed(local_cluster: LocalCluster) -> None:
    """A slot migrates to another master after the store read the slot map: a MOVED reply, one re-read, a hit."""
    store = open_store(local_cluster.url, NS)
    assert store.put("moving", b"payload") and store.get("moving") == b"payload"
    name = store.redis_key("moving").encode()
    src = local_cluster.owner(name)
    dst = (src + 1) % 3
    from kvtc.store.redis_cluster import key_slot

    slot = key_slot(name)
    a, b = local_cluster.client(src), local_cluster.client(dst)
    src_id, dst_id = a.execute_command("CLUSTER", "MYID").decode(), b.execute_command("CLUSTER", "MYID").decode()
    b.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    a.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    a.execute_command("MIGRATE", "127.0.0.1", local_cluster.nodes[dst].port, name, 0, 5000)
    for c in (b, a):
        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    assert b.execute_command("EXISTS", name) == 1
    time.sleep(0.15)  # past the least interval between two reads of the slot map
    assert store.get("moving") == b"payload" and store.put("moving", b"again") and b.get(name) is not None
    assert store.stats()["errors"] == 0
    # give the slot back, so that the cluster has its even split for the next test
    a.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", dst_id)
    b.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", src_id)
    b.execute_command("MIGRATE", "127.0.0.1", local_cluster.nodes[src].port, name, 0, 5000)
    for c in (a, b):
        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", src_id)
    local_cluster.wait_ok()


def test_dead_master_costs_only_its_keys(local_cluster: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(local_cluster.url + "?retry_interval=0.3", NS)
    keys = [f"chunk-{i}" for i in range(60)]
    items = {k: k.encode() * 10 for k in keys}
    assert all(store.put_many(items).values())
    owners = _owners(local_cluster, store, keys)
    local_cluster.nodes[1].kill()
    with caplog.at_level(logging.WARNING, logger="kvtc.store"):
        t0 = time.perf_counter()
        for _ in range(5):
            got = store.get_many(keys)
            assert got == {k: (None if owners[k] == 1 else items[k]) for k in keys}
            stored = store.put_many(items)
            assert stored == {k: owners[k] != 1 for k in keys}
            assert [store.get(k) for k in keys] == [got[k] for k in keys]
        assert time.perf_counter() - t0 < 3.0  # misses, not timeouts
    warnings = [r for r in caplog.records if "failed during" in r.getMessage()]
    assert len(warnings) == 1 and str(local_cluster.nodes[1].port) in warnings[0].getMessage()
    local_cluster.restart(1)
    deadline = time.monotonic() + 10
    victim = next(k for k in keys if owners[k] == 1)
    while not store.put(victim, b"back") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.get(victim) == b"back"
    assert all(store.put_many(items).values()) and store.get_many(keys) == items


def test_master_killed_under_four_processes(local_cluster: LocalCluster) -> None:
    """Acceptance: 4 writer/reader processes; one master SIGKILLed mid-run, restarted later. No process sees an
    exception, keys of the other masters keep hitting, no read is corrupt, and hits on the killed master's keys
    resume after the restart."""
    from store_concurrency import collect_workers, start_workers, summarize

    cfg = {
        "procs": 4,
        "seconds": 12.0,
        "keys": 48,
        "min_value": 1 << 10,
        "max_value": 16 << 10,
        "write_fraction": 0.4,
        "seed": 7,
        "warmup": 2.0,
        "trace": True,
    }
    url = local_cluster.url + "?retry_interval=0.5"
    probe = open_store(url, NS)
    owner = {i: local_cluster.owner(probe.redis_key(f"chunk-{i}").encode()) for i in range(cfg["keys"])}
    assert set(owner.values()) == {0, 1, 2}
    start_at, out, procs = start_workers(url, NS, cfg)
    time.sleep(max(0.0, start_at + 3.0 - time.time()))
    killed_at = time.time()
    local_cluster.nodes[1].kill()
    time.sleep(max(0.0, start_at + 6.0 - time.time()))
    restart_at = time.time()
    local_cluster.restart(1)
    whole_at = time.time()
    reports = collect_workers("cluster", cfg, out, procs)  # raises if a worker raised
    result = summarize("cluster", cfg, reports)
    assert result["corrupt_reads"] == 0 and result["store_corrupt"] == 0
    events = [e for r in reports for e in r["trace"]]

    def gets(lo: float, hi: float, dead: bool) -> list[bool]:
        return [hit for t, i, is_put, hit in events if not is_put and lo <= t < hi and (owner[i] == 1) == dead]

    others_down = gets(killed_at + 0.2, restart_at, dead=False)
    dead_down = gets(killed_at + 0.2, restart_at, dead=True)
    dead_after = gets(whole_at + 1.0, float("inf"), dead=True)
    print(
        f"\n{local_cluster.kind} cluster, master 1 down {restart_at - killed_at:.1f} s: other masters' keys "
        f"{sum(others_down)}/{len(others_down)} gets hit; its keys {sum(dead_down)}/{len(dead_down)}; after the "
        f"restart {sum(dead_after)}/{len(dead_after)}; {result['corrupt_reads']} corrupt reads, "
        f"{result['store_errors']} errors counted, {result['put_failures']} puts refused"
    )
    assert len(others_down) > 50 and sum(others_down) / len(others_down) > 0.9, (len(others_down), sum(others_down))
    assert dead_down and not any(dead_down)  # its data died with it: only misses, and no exception
    assert dead_after and any(dead_after), len(dead_after)
    assert result["store_errors"] > 0 and result["put_failures"] > 0


def test_hung_master_costs_one_timeout_per_retry_interval(local_cluster: LocalCluster) -> None:
    """A master that stops answering (SIGSTOP: connections stay open, replies never come) costs its keys one socket
    timeout, then misses without waiting until `retry_interval` has passed; the other masters keep hitting."""
    store = open_store(local_cluster.url + "?timeout=0.3&retry_interval=2", NS)
    keys = [f"chunk-{i}" for i in range(30)]
    items = {k: k.encode() for k in keys}
    assert all(store.put_many(items).values())
    owners = _owners(local_cluster, store, keys)
    expected = {k: (None if owners[k] == 1 else items[k]) for k in keys}
    process = local_cluster.nodes[1].process
    process.send_signal(signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        assert store.get_many(keys) == expected
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(10):
            assert store.get_many(keys) == expected
        later = time.perf_counter() - t0
    finally:
        process.send_signal(signal.SIGCONT)
    assert 0.25 < first < 1.5 and later < 0.5, (first, later)
    time.sleep(2.1)
    assert store.get_many(keys) == items  # answered again: every key hits
