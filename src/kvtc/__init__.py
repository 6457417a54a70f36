"""kvtc: KV cache transform coding for compact storage of LLM KV caches.

Implements KVTC (Staniszewski & Łańcucki, "KV Cache Transform Coding for Compact Storage in LLM
Inference", ICLR 2026): pre-RoPE PCA across layers and heads, dynamic-programming bit allocation,
quantization and entropy coding.
"""

from typing import TYPE_CHECKING, Any

from .errors import CalibrationError, CalibrationMismatch, FormatError, KVTCError, LayoutError, UnsupportedModel

if TYPE_CHECKING:
    from .layout import KVLayout, KVSlice, PCAGrouping

__version__ = "0.1.0"

#: imported on first use (they need torch): ``import kvtc`` and ``kvtc --help`` stay fast
_LAZY = {"KVLayout": "layout", "KVSlice": "layout", "PCAGrouping": "layout"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CalibrationError",
    "CalibrationMismatch",
    "FormatError",
    "KVLayout",
    "KVSlice",
    "KVTCError",
    "LayoutError",
    "PCAGrouping",
    "UnsupportedModel",
    "__version__",
]
