"""Walking a file store's root without following links: every path below the root is reached one component
at a time from an open directory descriptor (``O_NOFOLLOW``, ``dir_fd``), so a link planted in the store
(a shard directory, an entry, a temp file) never leads a read, write, rename or removal outside it."""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
DIR_FLAGS = ROOT_FLAGS | os.O_NOFOLLOW
#: What ``open(O_DIRECTORY | O_NOFOLLOW)`` answers for a link or a file.
NOT_A_DIR = (errno.ENOTDIR, errno.ELOOP)
SHARD_RE = re.compile(r"^[0-9a-f]{2}$")


class OpenDir:
    """An open directory descriptor, closed on leaving a ``with`` block."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> OpenDir:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def listing(fd: int) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(fd) as it:
            return list(it)
    except OSError:
        return []


def open_dir(parent: int, name: str) -> int | None:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError:  # gone, or not a directory (a link is never followed)
        return None


def leaves(root: Path) -> Iterator[OpenDir]:
    """Every shard leaf directory under `root`, reached without following links; the caller closes each."""
    try:
        root_fd = os.open(root, ROOT_FLAGS)
    except FileNotFoundError:
        return
    try:
        for shard in listing(root_fd):
            if not SHARD_RE.match(shard.name) or (shard_fd := open_dir(root_fd, shard.name)) is None:
                continue
            try:
                for leaf in listing(shard_fd):
                    if SHARD_RE.match(leaf.name) and (leaf_fd := open_dir(shard_fd, leaf.name)) is not None:
                        yield OpenDir(leaf_fd)
            finally:
                os.close(shard_fd)
    finally:
        os.close(root_fd)


def regular_size(leaf: int, name: str) -> int:
    """The size of the regular file `name` in `leaf` (0 if absent or not a regular file: not in the usage)."""
    try:
        st = os.stat(name, dir_fd=leaf, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def fsync_dir(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # some filesystems cannot sync a directory
            raise


def unlink_quietly(name: str, leaf: int) -> None:
    try:
        os.unlink(name, dir_fd=leaf)
    except OSError:
        pass
