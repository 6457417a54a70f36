"""Atomic file writes: the one place kvtc replaces a file on disk."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

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
        raise StoreError(f"writing {path} failed ({e.strerror or e}); the previous file, if any, is unchanged") from None
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
