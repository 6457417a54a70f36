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


def moved_attributes(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module`` whose attributes ``names`` moved to the modules they map to: each
    still resolves, with a ``DeprecationWarning`` naming the new place, for one release."""
    import warnings

    def __getattr__(name: str) -> Any:
        if name in names:
            warnings.warn(
                f"{module}.{name} moved to {names[name]}.{name}; import it from there (the old path goes in the next "
                "release)",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def moved_module(old: str, new: str) -> None:
    """Make the module ``old`` (the caller's ``__name__``) an alias of ``new``, with a ``DeprecationWarning`` naming
    ``new``, for one release. The alias is the moved module itself, so patching either name patches both."""
    import sys
    import warnings

    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
