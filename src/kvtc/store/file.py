"""Filesystem store, the default: ``file:///var/cache/kvtc?max_bytes=20GiB``.

Layout under the root directory::

    .kvtc-store                     lock file; also holds the shared usage record
    ab/cd/abcd<28 hex>.kvs          one envelope per entry (see `kvtc.store.base`), named by
                                    `entry_id(namespace, key)`, sharded on its first 2 x 2 hex digits
    ab/cd/.<32 hex>.<pid>.<rand>.tmp  a write in progress (or left by a killed writer)

Any number of processes and threads may share a root; every namespace in it shares the budget.

Writes are atomic: the envelope goes to a temp file in the entry's directory, is fsynced, renamed
over the entry, and the directory is fsynced. A reader sees the old entry, the new one or none,
never a torn one; a writer killed at any point leaves at most a temp file, which a later sweep
removes once it is older than ``tmp_grace`` seconds. Entries are never modified in place, so a
failed write (disk full, permission denied) cannot damage what is already stored.

Reads check the envelope; a torn, corrupt or foreign entry is a miss, is removed and is counted in
``stats()["corrupt"]``. Entry files are opened without blocking and without following links: anything
but a regular file at an entry's path (a FIFO, a device, a link) is treated the same way.

Budget: with ``max_bytes`` set, the total size of the entry files is bounded. Recency is the entry
file's mtime, set on write and on every hit (so it works on ``noatime`` mounts). The running total
lives in the lock file's usage record (u64 bytes held, u64 time of the last sweep in ns, little-
endian) and is updated under an exclusive ``flock`` with each rename or removal. When it exceeds
``max_bytes``, the writer sweeps: it scans the root and removes the least recently used entries
until the total is at most ``evict_to * max_bytes``. A sweep also runs every ``sweep_interval``
seconds; it recomputes the total from the files, which corrects any drift left by a process killed
between its rename and its usage update, and removes stale temp files. ``flock`` is released by the
kernel when its holder dies, so a killed process cannot wedge the store. The lock must be honoured
by every host that shares the root: use a local filesystem.

URL options: ``max_bytes`` (e.g. ``20GiB``; default unbounded), ``evict_to`` (fraction of the
budget a sweep evicts down to, default 0.9), ``tmp_grace`` (seconds, default 900),
``sweep_interval`` (seconds, default 300).
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import re
import secrets
import stat
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import FormatError, StoreError
from .base import HEADER_SIZE, Store, _payload_bytes, entry_id, parse_header, seal, unseal

#: Fraction of `max_bytes` a sweep evicts down to, so that a full store is not swept on every put.
DEFAULT_EVICT_TO = 0.9
#: Age in seconds after which a temp file is taken to belong to a dead writer.
DEFAULT_TMP_GRACE_S = 900.0
#: Seconds between periodic sweeps (drift correction and temp file cleanup).
DEFAULT_SWEEP_INTERVAL_S = 300.0

LOCK_NAME = ".kvtc-store"
ENTRY_SUFFIX = ".kvs"
_USAGE = struct.Struct("<QQ")  # bytes held, time of the last sweep (ns since the epoch)
_SHARD_RE = re.compile(r"^[0-9a-f]{2}$")
_ENTRY_RE = re.compile(r"^[0-9a-f]{32}\.kvs$")
_TEMP_RE = re.compile(r"^\.[0-9a-f]{32}\.\d+\.[0-9a-f]{8}\.tmp$")


class FileStore(Store):
    """Sharded directory of envelope files with atomic writes and an optional LRU byte budget."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: str,
        max_bytes: int | None = None,
        *,
        evict_to: float = DEFAULT_EVICT_TO,
        tmp_grace: float = DEFAULT_TMP_GRACE_S,
        sweep_interval: float = DEFAULT_SWEEP_INTERVAL_S,
    ) -> None:
        super().__init__(namespace)
        if max_bytes is not None and max_bytes <= 0:
            raise StoreError(f"max_bytes must be positive, got {max_bytes}")
        if not 0.0 < evict_to <= 1.0:
            raise StoreError(f"evict_to must be in (0, 1], got {evict_to}")
        for name, value in (("tmp_grace", tmp_grace), ("sweep_interval", sweep_interval)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise StoreError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.evict_to = evict_to
        self.tmp_grace = tmp_grace
        self.sweep_interval = sweep_interval
        self._lock_path = self.root / LOCK_NAME
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with self._locked() as fd:
                if len(os.pread(fd, _USAGE.size, 0)) < _USAGE.size:
                    self._sweep_locked(fd, self.tmp_grace)
        except (OSError, ValueError) as e:  # ValueError: a path no system call accepts (NUL)
            raise StoreError(
                f"cannot use {str(self.root)!r} as a kvtc file store ({getattr(e, 'strerror', None) or e}); "
                "pass a writable directory in the file:// URL"
            ) from e

    # -- paths -------------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """Where the entry for `key` in this namespace lives (it may not exist)."""
        eid = entry_id(self.namespace, key)
        return self.root / eid[:2] / eid[2:4] / (eid + ENTRY_SUFFIX)

    @contextmanager
    def _locked(self) -> Iterator[int]:
        # A fresh open file description per critical section: flock then excludes other threads
        # of this process as well as other processes, and survives fork.
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _read_usage(fd: int) -> tuple[int, int]:
        raw = os.pread(fd, _USAGE.size, 0)
        return _USAGE.unpack(raw) if len(raw) == _USAGE.size else (0, 0)

    # -- Store -------------------------------------------------------------------------------

    def put(self, key: str, value: bytes) -> bool:
        blob = seal(self.namespace, key, _payload_bytes(value))
        if self.max_bytes is not None and len(blob) > self.max_bytes:
            self._warn(
                "too-large",
                "kvtc.store: entry of %d bytes exceeds the file store budget of %d bytes; not stored",
                len(blob),
                self.max_bytes,
            )
            return False
        path = self.path_of(key)
        tmp = path.parent / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._write_temp(tmp, blob)
            evicted = 0
            with self._locked() as fd:
                held, last_sweep = self._read_usage(fd)
                try:
                    old = os.stat(path).st_size
                except FileNotFoundError:
                    old = 0
                os.replace(tmp, path)
                held = max(0, held + len(blob) - old)
                os.pwrite(fd, _USAGE.pack(held, last_sweep), 0)
                over = self.max_bytes is not None and held > self.max_bytes
                if over or time.time_ns() - last_sweep > self.sweep_interval * 1e9:
                    evicted = self._sweep_locked(fd, self.tmp_grace, keep=str(path))["evicted"]
            self._fsync_dir(path.parent)
        except OSError as e:
            _unlink_quietly(tmp)
            self._count(errors=1)
            self._warn(
                f"put-{e.errno}",
                "kvtc.store: cannot write %s (%s); entry not stored, existing entries are intact",
                path,
                e.strerror or e,
            )
            return False
        self._count(puts=1, evictions=evicted)
        return True

    def get(self, key: str) -> bytes | None:
        path = self.path_of(key)
        try:
            # Never blocks (a FIFO planted at the path would) and never follows a link out of the store.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symbolic link where an entry belongs
                return self._not_an_entry(path)
            return self._read_failed(path, e)
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            return self._read_failed(path, e)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return self._not_an_entry(path)
        try:
            with open(fd, "rb", buffering=0) as f:
                try:
                    head = f.read(HEADER_SIZE)
                    total = parse_header(head)
                    if total != st.st_size:
                        raise FormatError(f"store entry is {st.st_size} bytes, its header says {total}: torn")
                    blob = bytearray(total)
                    blob[:HEADER_SIZE] = head
                    view = memoryview(blob)
                    got = HEADER_SIZE
                    while got < total:
                        n = f.readinto(view[got:])
                        if not n:
                            raise FormatError(f"store entry ended after {got} of {total} bytes: truncated")
                        got += n
                    payload = unseal(self.namespace, key, blob)
                except FormatError as e:
                    self._remove_corrupt(path, st, e)
                    return None
                try:
                    now = time.time_ns()
                    os.utime(f.fileno(), ns=(now, now))
                except OSError:
                    pass  # recency is advisory; a read-only store still serves hits
        except OSError as e:
            return self._read_failed(path, e)
        self._count(hits=1)
        return payload

    def _read_failed(self, path: Path, e: OSError) -> None:
        self._count(misses=1, errors=1)
        self._warn(f"get-{e.errno}", "kvtc.store: cannot read %s (%s); treated as a miss", path, e.strerror or e)
        return None

    def _not_an_entry(self, path: Path) -> None:
        try:
            seen = os.lstat(path)
        except OSError:
            self._count(misses=1)
            return None
        self._remove_corrupt(path, seen, FormatError("not a regular file"))
        return None

    def contains(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def delete(self, key: str) -> bool:
        path = self.path_of(key)
        try:
            with self._locked() as fd:
                try:
                    size = os.stat(path).st_size
                    os.unlink(path)
                except FileNotFoundError:
                    return False
                held, last_sweep = self._read_usage(fd)
                os.pwrite(fd, _USAGE.pack(max(0, held - size), last_sweep), 0)
        except OSError as e:
            self._count(errors=1)
            self._warn(f"delete-{e.errno}", "kvtc.store: cannot delete %s (%s)", path, e.strerror or e)
            return False
        return True

    def stats(self) -> dict[str, int]:
        out = super().stats()
        try:
            fd = os.open(self._lock_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                out["bytes"] = self._read_usage(fd)[0]
            finally:
                os.close(fd)
        except OSError:
            pass
        return out

    # -- maintenance -------------------------------------------------------------------------

    def sweep(self, tmp_grace: float | None = None) -> dict[str, int]:
        """Recount the store, remove temp files older than `tmp_grace` seconds (default: the
        store's) and evict down to ``evict_to * max_bytes`` if over budget.

        Returns counts: entries, bytes (after the sweep), evicted, temp_removed.
        """
        with self._locked() as fd:
            result = self._sweep_locked(fd, self.tmp_grace if tmp_grace is None else tmp_grace)
        self._count(evictions=result["evicted"])
        return result

    def _sweep_locked(self, lock_fd: int, tmp_grace: float, keep: str | None = None) -> dict[str, int]:
        now = time.time_ns()
        entries: list[tuple[int, int, str]] = []  # mtime_ns, size, path
        temp_removed = 0
        for shard in _subdirs(str(self.root)):
            for leaf in _subdirs(shard):
                try:
                    listing = list(os.scandir(leaf))
                except FileNotFoundError:
                    continue
                for item in listing:
                    try:
                        if _ENTRY_RE.match(item.name):
                            st = item.stat(follow_symlinks=False)
                            entries.append((st.st_mtime_ns, st.st_size, item.path))
                        elif _TEMP_RE.match(item.name):
                            if now - item.stat(follow_symlinks=False).st_mtime_ns > tmp_grace * 1e9:
                                os.unlink(item.path)
                                temp_removed += 1
                    except FileNotFoundError:
                        continue
        held = sum(size for _, size, _ in entries)
        evicted = 0
        if self.max_bytes is not None and held > self.max_bytes:
            target = int(self.max_bytes * self.evict_to)
            entries.sort()
            for _, size, path in entries:
                if held <= target:
                    break
                if path == keep:  # the entry just written stays even if it alone exceeds the target
                    continue
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                held -= size
                evicted += 1
        os.pwrite(lock_fd, _USAGE.pack(held, now), 0)
        return {"entries": len(entries) - evicted, "bytes": held, "evicted": evicted, "temp_removed": temp_removed}

    def _write_temp(self, tmp: Path, blob: bytes) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
            now = time.time_ns()
            os.utime(fd, ns=(now, now))
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # some filesystems cannot sync a directory
                raise
        finally:
            os.close(fd)

    def _remove_corrupt(self, path: Path, seen: os.stat_result, why: FormatError) -> None:
        self._count(misses=1, corrupt=1)
        self._warn("corrupt", "kvtc.store: removed bad entry %s: %s", path, why)
        try:
            with self._locked() as fd:
                try:
                    now = os.lstat(path)
                except FileNotFoundError:
                    return
                # Only the file that was read: a writer may have renamed a good one over it since.
                if (now.st_ino, now.st_dev) == (seen.st_ino, seen.st_dev):
                    os.unlink(path)
                    if stat.S_ISREG(now.st_mode):  # only entry files are in the usage record
                        held, last_sweep = self._read_usage(fd)
                        os.pwrite(fd, _USAGE.pack(max(0, held - now.st_size), last_sweep), 0)
        except OSError as e:
            self._count(errors=1)
            self._warn(f"remove-{e.errno}", "kvtc.store: cannot remove bad entry %s (%s)", path, e.strerror or e)

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r}, namespace={self.namespace!r}, max_bytes={self.max_bytes})"


def _subdirs(parent: str) -> list[str]:
    try:
        return [e.path for e in os.scandir(parent) if _SHARD_RE.match(e.name) and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
