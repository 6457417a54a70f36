"""Hostile input, round 2, file store: someone with write access to a shared store directory plants entries
whose envelopes declare gigabytes, and links (a shard directory, an entry, a temp file, the lock file) that lead
outside the root. A read is a miss, with bounded time and memory; nothing outside the root is read, written or
removed."""

from __future__ import annotations

import os
import stat
import struct
import time
import tracemalloc
from pathlib import Path

import pytest

from kvtc.errors import StoreError
from kvtc.store import FileStore, entry_id, open_store, seal
from kvtc.store.base import HEADER_SIZE, MAGIC
from kvtc.store.file import DEFAULT_MAX_ENTRY_BYTES

NS = "model:calibration"


def _plant_claim(path: Path, key: str, payload_bytes: int, file_bytes: int | None = None) -> int:
    """An envelope header for (NS, key) that declares `payload_bytes` of payload, in a sparse file of
    `file_bytes` (default: exactly the size the header declares). Returns the declared total."""
    ns, k = NS.encode(), key.encode()
    head = struct.pack("<4sBBHHHQ", MAGIC, 1, 0, len(ns), len(k), 0, payload_bytes) + bytes(16)
    total = HEADER_SIZE + len(ns) + len(k) + payload_bytes
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(head + ns + k)
        f.truncate(total if file_bytes is None else file_bytes)
    return total


def _timed_get(store: FileStore, key: str) -> tuple[bytes | None, float, int]:
    """get(key): its value, seconds, and the peak Python allocation during it."""
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        value = store.get(key)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return value, seconds, peak


def test_envelope_claiming_more_than_the_default_limit_is_not_read(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s", NS)
    path = store.path_of("big")
    total = _plant_claim(path, "big", DEFAULT_MAX_ENTRY_BYTES)  # a sparse 4 GiB + header file: sizes agree
    value, seconds, peak = _timed_get(store, "big")  # the old store read it whole (or raised MemoryError)
    assert value is None and seconds < 0.5 and peak < 1 << 20, (seconds, peak)
    assert path.stat().st_size == total > store.max_entry_bytes == DEFAULT_MAX_ENTRY_BYTES == 4 << 30
    assert store.stats()["misses"] == 1 and store.stats()["errors"] == 1
    assert path.exists()  # not removed: another reader with a larger limit may want it
    assert store.put("fine", b"x") and store.get("fine") == b"x"


@pytest.mark.parametrize("file_bytes", [None, 100, 3 << 20])
def test_envelope_over_a_configured_limit_is_a_miss_with_bounded_memory(tmp_path: Path, file_bytes: int | None) -> None:
    store = open_store(f"file://{tmp_path}/s?max_entry_bytes=1MiB", NS)
    assert isinstance(store, FileStore) and store.max_entry_bytes == 1 << 20
    path = store.path_of("k")
    _plant_claim(path, "k", 64 << 20, file_bytes)  # declares 64 MiB; the file is that size, or not
    value, seconds, peak = _timed_get(store, "k")
    assert value is None and seconds < 0.5 and peak < 256 << 10, (seconds, peak)
    # a file whose size disagrees with its header is torn: removed; one that agrees is only too large: kept
    assert path.exists() == (file_bytes is None)
    assert not store.put("k", bytes(2 << 20))  # never writes what it would refuse to read
    assert store.put("k", bytes(1000)) and store.get("k") == bytes(1000)


def test_max_entry_bytes_option_is_checked() -> None:
    for bad in ("0", "-1", "lots", "99999999999999999999999"):
        with pytest.raises(StoreError, match="max_entry_bytes"):
            open_store(f"file:///tmp/kvtc-unused?max_entry_bytes={bad}", NS)
    for bad_value in (0, -5, 1.5, True):
        with pytest.raises(StoreError, match="max_entry_bytes"):
            FileStore("/tmp/kvtc-unused", NS, max_entry_bytes=bad_value)  # type: ignore[arg-type]


# -- links -----------------------------------------------------------------------------------


def _outside_store(tmp_path: Path, key: str, payload: bytes) -> tuple[Path, Path]:
    """A directory outside the store root laid out like a shard, holding a valid entry for `key`."""
    eid = entry_id(NS, key)
    outside = tmp_path / "outside"
    entry = outside / eid[:2] / eid[2:4] / f"{eid}.kvs"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(seal(NS, key, payload))
    return outside, entry


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("level", ["shard", "leaf"])
def test_symlinked_shard_directory_is_never_followed(tmp_path: Path, level: str) -> None:
    store = FileStore(tmp_path / "s", NS, max_bytes=1 << 20, sweep_interval=0)
    assert store.put("neighbour", b"fine")
    outside, entry = _outside_store(tmp_path, "victim", b"planted outside the root")
    eid = entry_id(NS, "victim")
    link = store.root / eid[:2] if level == "shard" else store.root / eid[:2] / eid[2:4]
    if link.exists():
        pytest.skip("the neighbour's shard is the victim's")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside if level == "shard" else outside / eid[:2] / eid[2:4], target_is_directory=True)
    before = _tree(outside)
    assert store.get("victim") is None  # the old store followed the link and returned the planted payload
    assert not store.contains("victim")
    assert not store.put("victim", b"mine")  # nothing is written through the link
    assert not store.delete("victim")
    store.sweep()
    assert _tree(outside) == before and entry.exists()
    assert store.get("neighbour") == b"fine" and store.stats()["errors"] >= 2
    assert link.is_symlink()  # neither followed nor replaced: an operator removes it
    link.unlink()
    assert store.put("victim", b"mine") and store.get("victim") == b"mine" and _tree(outside) == before


def test_symlinked_entry_is_replaced_not_written_through(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s", NS)
    outside = tmp_path / "outside.kvs"
    outside.write_bytes(seal(NS, "victim", b"planted"))
    path = store.path_of("victim")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(outside)
    assert not store.contains("victim")  # the old store's contains followed the link
    assert store.put("victim", b"mine") and store.get("victim") == b"mine"
    assert not path.is_symlink() and outside.read_bytes() == seal(NS, "victim", b"planted")


@pytest.mark.parametrize("dangling", [False, True])
def test_symlinked_temp_file_is_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dangling: bool
) -> None:
    import kvtc.store.file as file_module

    store = FileStore(tmp_path / "s", NS)
    monkeypatch.setattr(file_module.secrets, "token_hex", lambda n: "0badc0de")
    eid = entry_id(NS, "victim")
    tmp = store.path_of("victim").parent / f".{eid}.{os.getpid()}.0badc0de.tmp"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "target"
    if not dangling:
        target.write_bytes(b"precious")
    tmp.symlink_to(target)
    assert not store.put("victim", b"mine")
    assert (target.read_bytes() == b"precious") if not dangling else not target.exists()
    assert tmp.is_symlink() and store.get("victim") is None


def test_symlinked_lock_file_is_never_written_through(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s", NS)
    assert store.put("a", b"1")
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious data, not a usage record")
    lock = store.root / ".kvtc-store"
    lock.unlink()
    lock.symlink_to(precious)
    assert not store.put("b", b"2") and not store.delete("a")  # the old store wrote its usage record there
    assert isinstance(store.stats(), dict)
    with pytest.raises(StoreError):
        FileStore(store.root, NS)
    assert precious.read_bytes() == b"precious data, not a usage record"
    assert stat.S_ISLNK(os.lstat(lock).st_mode)
