"""kvtc: KV cache transform coding for compact storage of LLM KV caches.

Implements KVTC (Staniszewski & Łańcucki, "KV Cache Transform Coding for Compact Storage in LLM
Inference", ICLR 2026): pre-RoPE PCA across layers and heads, dynamic-programming bit allocation,
quantization and entropy coding.
"""

from .errors import CalibrationError, CalibrationMismatch, FormatError, KVTCError, LayoutError, UnsupportedModel
from .layout import KVLayout, KVSlice, PCAGrouping

__version__ = "0.1.0"

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
