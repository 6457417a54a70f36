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
but a regular file at an entry's path (a FIFO, a device, a link) is treated the same way. Every path
below the root is walked one component at a time from the root's descriptor, never following a link
(``O_NOFOLLOW``, ``*at`` calls), so nothing outside the root is read, written, renamed or removed through
a link planted in it: a shard directory that is a link (or anything but a directory) makes its entries
misses and their writes fail (with a warning), and the lock file and temp files are never opened through one. An entry whose envelope
declares more than ``max_entry_bytes`` is a miss without its payload being read (its header is checked
against the file's size first); ``put`` refuses one as large.

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
``sweep_interval`` (seconds, default 300), ``max_entry_bytes`` (largest entry read or written,
default 4GiB).
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
from ..textsafe import printable
from .base import HEADER_SIZE, Store, _payload_bytes, entry_id, parse_header, seal, unseal
from .fsdir import DIR_FLAGS, NOT_A_DIR, ROOT_FLAGS, fsync_dir, leaves, listing, regular_size, unlink_quietly

#: Fraction of `max_bytes` a sweep evicts down to, so that a full store is not swept on every put.
DEFAULT_EVICT_TO = 0.9
#: Age in seconds after which a temp file is taken to belong to a dead writer.
DEFAULT_TMP_GRACE_S = 900.0
#: Seconds between periodic sweeps (drift correction and temp file cleanup).
DEFAULT_SWEEP_INTERVAL_S = 300.0
#: Largest entry (envelope bytes) read or written; a larger one is a miss, read no further than its header.
DEFAULT_MAX_ENTRY_BYTES = 4 << 30
MAX_ENTRY_LIMIT = 2**63 - 1

LOCK_NAME = ".kvtc-store"
ENTRY_SUFFIX = ".kvs"
_USAGE = struct.Struct("<QQ")  # bytes held, time of the last sweep (ns since the epoch)
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
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    ) -> None:
        super().__init__(namespace)
        if max_bytes is not None and max_bytes <= 0:
            raise StoreError(f"max_bytes must be positive, got {max_bytes}")
        if not 0.0 < evict_to <= 1.0:
            raise StoreError(f"evict_to must be in (0, 1], got {evict_to}")
        for name, value in (("tmp_grace", tmp_grace), ("sweep_interval", sweep_interval)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise StoreError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if isinstance(max_entry_bytes, bool) or not isinstance(max_entry_bytes, int):
            raise StoreError(f"max_entry_bytes must be an integer, got {max_entry_bytes!r}")
        if not 1 <= max_entry_bytes <= MAX_ENTRY_LIMIT:
            raise StoreError(f"max_entry_bytes must be in 1..{MAX_ENTRY_LIMIT}, got {max_entry_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.evict_to = evict_to
        self.tmp_grace = tmp_grace
        self.sweep_interval = sweep_interval
        self.max_entry_bytes = max_entry_bytes
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
    def _leaf(self, eid: str, create: bool = False) -> Iterator[int]:
        """A descriptor of the directory of entry `eid`, reached from the root one component at a time without
        following links (made with `create`). A component that is not a directory (a link, a file) is an
        OSError: the store neither follows nor replaces it, so its entries are misses and writes fail."""
        try:
            fds = [os.open(self.root, ROOT_FLAGS)]
        except FileNotFoundError:
            if not create:
                raise
            self.root.mkdir(parents=True, exist_ok=True)  # removed since: made again, as a write always did
            fds = [os.open(self.root, ROOT_FLAGS)]
        try:
            for name in (eid[:2], eid[2:4]):
                fds.append(self._subdir(fds[-1], name, create))
            yield fds[-1]
        finally:
            for fd in fds:
                os.close(fd)

    @staticmethod
    def _subdir(parent: int, name: str, create: bool) -> int:
        for _ in range(2):
            try:
                return os.open(name, DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                if not create:
                    raise
            except OSError as e:
                if e.errno in NOT_A_DIR:
                    raise OSError(errno.ENOTDIR, "a shard is not a directory (links are not followed)", name) from None
                raise
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                pass
        raise FileNotFoundError(errno.ENOENT, "a shard directory was removed while it was made", name)

    @contextmanager
    def _locked(self) -> Iterator[int]:
        # A fresh open file description per critical section: flock then excludes other threads
        # of this process as well as other processes, and survives fork.
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
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
        for limit, what in ((self.max_entry_bytes, "max_entry_bytes"), (self.max_bytes, "the file store budget")):
            if limit is not None and len(blob) > limit:
                self._warn(
                    "too-large",
                    "kvtc.store: entry of %d bytes exceeds %s of %d bytes; not stored",
                    len(blob),
                    what,
                    limit,
                )
                return False
        eid = entry_id(self.namespace, key)
        name, tmp = eid + ENTRY_SUFFIX, f".{eid}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        path = self.path_of(key)
        try:
            with self._leaf(eid, create=True) as leaf:
                self._write_temp(leaf, tmp, blob)  # O_EXCL: a name planted there (a link) fails it, untouched
                evicted = 0
                try:
                    with self._locked() as fd:
                        held, last_sweep = self._read_usage(fd)
                        old = regular_size(leaf, name)
                        os.replace(tmp, name, src_dir_fd=leaf, dst_dir_fd=leaf)
                        held = max(0, held + len(blob) - old)
                        os.pwrite(fd, _USAGE.pack(held, last_sweep), 0)
                        over = self.max_bytes is not None and held > self.max_bytes
                        if over or time.time_ns() - last_sweep > self.sweep_interval * 1e9:
                            evicted = self._sweep_locked(fd, self.tmp_grace, keep=eid)["evicted"]
                except OSError:
                    unlink_quietly(tmp, leaf)
                    raise
                fsync_dir(leaf)
        except OSError as e:
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
        eid = entry_id(self.namespace, key)
        path = self.path_of(key)
        try:
            with self._leaf(eid) as leaf:
                return self._read(leaf, eid + ENTRY_SUFFIX, path, key)
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except OSError as e:
            return self._read_failed(path, e)

    def _read(self, leaf: int, name: str, path: Path, key: str) -> bytes | None:
        try:
            # Never blocks (a FIFO planted at the path would) and never follows a link out of the store.
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=leaf)
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symbolic link where an entry belongs
                return self._not_an_entry(leaf, name, path)
            raise
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return self._not_an_entry(leaf, name, path)
            try:
                head = f.read(HEADER_SIZE)
                total = parse_header(head)
                if total != st.st_size:  # checked before any payload is read, as is the limit below
                    raise FormatError(f"store entry is {st.st_size} bytes, its header says {total}: torn")
                if total > self.max_entry_bytes:
                    self._count(misses=1, errors=1)
                    self._warn(
                        "too-large-entry",
                        "kvtc.store: entry %s is %d bytes, more than max_entry_bytes=%d; a miss (not read)",
                        path,
                        total,
                        self.max_entry_bytes,
                    )
                    return None
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
                self._remove_corrupt(leaf, name, path, st, e)
                return None
            except MemoryError:
                return self._read_failed(path, OSError(errno.ENOMEM, f"no memory for an entry of {total} bytes"))
            try:
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
            except OSError:
                pass  # recency is advisory; a read-only store still serves hits
        self._count(hits=1)
        return payload

    def _read_failed(self, path: Path, e: OSError) -> None:
        self._count(misses=1, errors=1)
        self._warn(f"get-{e.errno}", "kvtc.store: cannot read %s (%s); treated as a miss", path, e.strerror or e)
        return None

    def _not_an_entry(self, leaf: int, name: str, path: Path) -> None:
        try:
            seen = os.stat(name, dir_fd=leaf, follow_symlinks=False)
        except OSError:
            self._count(misses=1)
            return None
        self._remove_corrupt(leaf, name, path, seen, FormatError("not a regular file"))
        return None

    def contains(self, key: str) -> bool:
        eid = entry_id(self.namespace, key)
        try:
            with self._leaf(eid) as leaf:
                return stat.S_ISREG(os.stat(eid + ENTRY_SUFFIX, dir_fd=leaf, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def delete(self, key: str) -> bool:
        eid = entry_id(self.namespace, key)
        path = self.path_of(key)
        try:
            with self._leaf(eid) as leaf, self._locked() as fd:
                size = regular_size(leaf, eid + ENTRY_SUFFIX)
                os.unlink(eid + ENTRY_SUFFIX, dir_fd=leaf)
                held, last_sweep = self._read_usage(fd)
                os.pwrite(fd, _USAGE.pack(max(0, held - size), last_sweep), 0)
        except FileNotFoundError:
            return False
        except OSError as e:
            self._count(errors=1)
            self._warn(f"delete-{e.errno}", "kvtc.store: cannot delete %s (%s)", path, e.strerror or e)
            return False
        return True

    def stats(self) -> dict[str, int]:
        out = super().stats()
        try:
            fd = os.open(self._lock_path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
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
        entries: list[tuple[int, int, str]] = []  # mtime_ns, size, entry id
        temp_removed = 0
        for leaf in leaves(self.root):
            with leaf:
                for item in listing(leaf.fd):
                    is_entry = _ENTRY_RE.match(item.name) is not None
                    if not (is_entry or _TEMP_RE.match(item.name)):
                        continue
                    try:
                        st = item.stat(follow_symlinks=False)
                        if is_entry and stat.S_ISREG(st.st_mode):
                            entries.append((st.st_mtime_ns, st.st_size, item.name[:32]))
                        elif not is_entry and now - st.st_mtime_ns > tmp_grace * 1e9:
                            os.unlink(item.name, dir_fd=leaf.fd)  # a link named so is removed, not followed
                            temp_removed += 1
                    except FileNotFoundError:
                        continue
        held = sum(size for _, size, _ in entries)
        evicted = 0
        if self.max_bytes is not None and held > self.max_bytes:
            target = int(self.max_bytes * self.evict_to)
            entries.sort()
            for _, size, eid in entries:
                if held <= target:
                    break
                if eid == keep:  # the entry just written stays even if it alone exceeds the target
                    continue
                try:
                    with self._leaf(eid) as leaf:
                        os.unlink(eid + ENTRY_SUFFIX, dir_fd=leaf)
                except FileNotFoundError:
                    pass
                except OSError:  # its shard was replaced meanwhile (by a link, say): left for the next sweep
                    continue
                held -= size
                evicted += 1
        os.pwrite(lock_fd, _USAGE.pack(held, now), 0)
        return {"entries": len(entries) - evicted, "bytes": held, "evicted": evicted, "temp_removed": temp_removed}

    @staticmethod
    def _write_temp(leaf: int, tmp: str, blob: bytes) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o644, dir_fd=leaf)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
            now = time.time_ns()
            os.utime(fd, ns=(now, now))
            os.fsync(fd)
        except BaseException:
            unlink_quietly(tmp, leaf)  # the file this call made, and only that
            raise
        finally:
            os.close(fd)

    def _remove_corrupt(self, leaf: int, name: str, path: Path, seen: os.stat_result, why: FormatError) -> None:
        self._count(misses=1, corrupt=1)
        self._warn("corrupt", "kvtc.store: removed bad entry %s: %s", path, printable(why))
        try:
            with self._locked() as fd:
                try:
                    now = os.stat(name, dir_fd=leaf, follow_symlinks=False)
                except FileNotFoundError:
                    return
                # Only the file that was read: a writer may have renamed a good one over it since.
                if (now.st_ino, now.st_dev) == (seen.st_ino, seen.st_dev):
                    os.unlink(name, dir_fd=leaf)
                    if stat.S_ISREG(now.st_mode):  # only entry files are in the usage record
                        held, last_sweep = self._read_usage(fd)
                        os.pwrite(fd, _USAGE.pack(max(0, held - now.st_size), last_sweep), 0)
        except OSError as e:
            self._count(errors=1)
            self._warn(f"remove-{e.errno}", "kvtc.store: cannot remove bad entry %s (%s)", path, e.strerror or e)

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r}, namespace={self.namespace!r}, max_bytes={self.max_bytes})"
