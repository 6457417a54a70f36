"""Attributes of a package imported on first use, so that importing it (and ``kvtc --help``) stays fast."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``names[name]`` (one of its submodules) the first
    time ``name`` is asked for."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(f".{names[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
