"""kvtc: KV cache transform coding for compact storage of LLM KV caches.

Implements KVTC (Staniszewski & Łańcucki, "KV Cache Transform Coding for Compact Storage in LLM
Inference", ICLR 2026): pre-RoPE PCA across layers and heads, dynamic-programming bit allocation,
quantization and entropy coding.
"""

from typing import TYPE_CHECKING

from .errors import (
    CalibrationError,
    CalibrationMismatch,
    ConfigError,
    FormatError,
    KVTCError,
    LayoutError,
    UnsupportedModel,
)
from .lazy import lazy_attributes

if TYPE_CHECKING:
    from .layout import KVLayout, KVSlice, PCAGrouping

__version__ = "0.1.0"

#: imported on first use (they need torch): ``import kvtc`` and ``kvtc --help`` stay fast
_LAZY = {"KVLayout": "layout", "KVSlice": "layout", "PCAGrouping": "layout"}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "CalibrationError",
    "CalibrationMismatch",
    "ConfigError",
    "FormatError",
    "KVLayout",
    "KVSlice",
    "KVTCError",
    "LayoutError",
    "PCAGrouping",
    "UnsupportedModel",
    "__version__",
]
