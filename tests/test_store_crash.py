"""Crash safety of the file store: writers SIGKILLed at random points never leave a readable bad entry."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

from kvtc.store import FileStore, unseal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from store_concurrency import process_context, value_ok, write_until_killed  # noqa: E402

NAMESPACE = "crash-model:crash-calibration"
WRITERS = 100
AT_ONCE = 8
KEYS = 24
SIZES = (32 << 10, 512 << 10)  # long enough writes that kills land inside write, fsync and rename
BUDGET = 3 << 20  # below the working set: eviction runs, under the lock, while writers die


def _check_all(store: FileStore) -> int:
    """Read every key; every answer must be a miss or an intact value. Returns the number of hits."""
    hits = 0
    for k in range(KEYS):
        key = f"chunk-{k}"
        value = store.get(key)
        if value is not None:
            assert value_ok(key, value), f"{key}: a reader received a damaged value"
            hits += 1
    return hits


def test_sigkilled_writers_never_leave_a_readable_bad_entry(tmp_path: Path) -> None:
    url = f"file://{tmp_path}?max_bytes={BUDGET}&tmp_grace=3600"
    store = FileStore(tmp_path, NAMESPACE, max_bytes=BUDGET, tmp_grace=3600)
    ctx = process_context()
    rng = random.Random(1234)
    running: list[list] = []  # [process, ready event, started at, kill at (once ready)]
    dead = []
    started = killed = 0
    reads_during = 0
    while killed < WRITERS:
        while started < WRITERS and len(running) < AT_ONCE:
            ready = ctx.Event()
            p = ctx.Process(target=write_until_killed, args=(url, NAMESPACE, KEYS, SIZES, started, ready), daemon=True)
            p.start()
            running.append([p, ready, time.monotonic(), None])
            started += 1
        now = time.monotonic()
        for item in running:
            if item[3] is None and item[1].is_set():
                # Kill at a random point of a later write (or while it is finishing the first).
                item[3] = now + rng.uniform(0.0, 0.08)
            assert item[3] is not None or now - item[2] < 30, "a writer never completed its first put"
        for item in [item for item in running if item[3] is not None and item[3] <= now]:
            p = item[0]
            os.kill(p.pid, signal.SIGKILL)
            dead.append(p)
            running.remove(item)
            killed += 1
            if killed % 10 == 0:
                reads_during += _check_all(store)  # readers while other writers are still running
        time.sleep(0.002)

    for p in dead:
        p.join(10)
        assert p.exitcode == -signal.SIGKILL

    # Afterwards: no entry file is torn, every read is a miss or intact, nothing was found corrupt.
    entries = sorted(tmp_path.glob("??/??/*.kvs"))
    keys_by_id = {store.path_of(f"chunk-{k}").name: f"chunk-{k}" for k in range(KEYS)}
    for path in entries:
        key = keys_by_id[path.name]
        assert value_ok(key, unseal(NAMESPACE, key, path.read_bytes()))
    assert _check_all(store) == len(entries) > 0
    assert store.stats()["corrupt"] == 0 and store.stats()["errors"] == 0
    assert reads_during > 0

    # Killed writers left temp files (evidence that kills landed mid-write); a sweep removes them
    # and recounts the budget, which kills between rename and usage update may have skewed.
    orphans = list(tmp_path.glob("??/??/.*.tmp"))
    assert orphans, "no kill landed inside a write; the test did not exercise what it claims"
    swept = store.sweep(tmp_grace=0)
    assert swept["temp_removed"] == len(orphans) and not list(tmp_path.glob("??/??/.*.tmp"))
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("??/??/*.kvs"))
    assert store.stats()["bytes"] == swept["bytes"] == on_disk <= BUDGET

    # The store keeps serving, across processes: a fresh writer's entry is read back here.
    ready = ctx.Event()
    p = ctx.Process(target=write_until_killed, args=(url, NAMESPACE, KEYS, SIZES, 10_000, ready), daemon=True)
    p.start()
    assert ready.wait(30)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert store.put("after", b"still serving") and store.get("after") == b"still serving"
    _check_all(store)
    assert store.stats()["corrupt"] == 0
