"""Optional fused GPU kernels (Triton) behind the codec's functions.

Imported lazily: a CPU-only install never imports Triton. :func:`available` says whether the fused path
can run on a tensor's device; the codec uses it for CUDA tensors and keeps the torch reference
(:mod:`kvtc.quant`, :mod:`kvtc.coding.packing`) everywhere else. The kernels compute exactly what the
reference computes (tests/test_gpu.py checks symbols and parameters bit for bit).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device: torch.device | str | None = None) -> bool:
    """True when the fused kernels can run on ``device`` (CUDA with Triton; ``KVTC_NO_KERNELS=1`` disables)."""
    if os.environ.get("KVTC_NO_KERNELS") == "1" or not _triton_importable():
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's CPU interpreter: tests of the kernels without a GPU
        return True
    dev = torch.device(device) if device is not None else None
    return (dev is None or dev.type == "cuda") and torch.cuda.is_available()


def quantize_pack(*args, **kwargs):  # noqa: D103 - documented in triton_quant
    from .triton_quant import quantize_pack as f

    return f(*args, **kwargs)


def unpack_dequantize(*args, **kwargs):  # noqa: D103 - documented in triton_quant
    from .triton_quant import unpack_dequantize as f

    return f(*args, **kwargs)


def rows_to_fp8(*args, **kwargs):  # noqa: D103 - documented in triton_fp8
    from .triton_fp8 import rows_to_fp8 as f

    return f(*args, **kwargs)


def region_crcs(*args, **kwargs):  # noqa: D103 - documented in triton_crc
    from .triton_crc import region_crcs as f

    return f(*args, **kwargs)


def rope_to_heads(*args, **kwargs):  # noqa: D103 - documented in triton_rope
    from .triton_rope import rope_to_heads as f

    return f(*args, **kwargs)


def rope_tables(*args, **kwargs):  # noqa: D103 - documented in triton_rope (RopeTables)
    from .triton_rope import RopeTables as f

    return f(*args, **kwargs)


__all__ = [
    "available",
    "quantize_pack",
    "region_crcs",
    "rope_tables",
    "rope_to_heads",
    "rows_to_fp8",
    "unpack_dequantize",
]
