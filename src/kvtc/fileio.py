"""Atomic file writes: the one place kvtc replaces a file on disk."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .errors import StoreError


def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path``: a temporary file in the same directory, fsync, rename over ``path``, fsync of
    the directory. A failure at any step removes the temporary file and leaves ``path`` as it was."""
    path = Path(path)
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise StoreError(f"cannot write {path}: {e.strerror or e}; pick a writable location") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise StoreError(
            f"writing {path} failed ({e.strerror or e}); the previous file, if any, is unchanged"
        ) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is already atomic
    finally:
        os.close(fd)


@contextmanager
def _open_regular(path: Path, what: str, error: type[Exception]) -> Iterator[tuple[BinaryIO, int]]:
    """``(file, size)`` of ``path`` opened for reading without blocking, only if it is a regular file (never a
    FIFO, a device or a directory); anything else raises ``error`` naming ``what`` the file should be."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}; check the path") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise error(f"{path} is not a regular file; give the path of {what}")
    with os.fdopen(fd, "rb") as f:
        try:
            yield f, st.st_size
        except OSError as e:
            raise error(f"cannot read {what} {path}: {e.strerror or e}") from None


def read_regular(path: str | os.PathLike[str], what: str, limit: int | None = None) -> bytes:
    """The bytes of ``path``, opened only if it is a regular file (never blocking on a FIFO, never reading a
    device), and only if it holds at most ``limit`` bytes: anything else is a :class:`~kvtc.errors.KVTCError`
    naming ``what`` the file should be."""
    from .errors import KVTCError

    with _open_regular(Path(path), what, KVTCError) as (f, size):
        if limit is not None and size > limit:
            raise KVTCError(f"{path} holds {size} bytes, more than {what} can ({limit}); check the path")
        return f.read()
