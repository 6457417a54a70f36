"""Quantizers of PCA coefficients: int2 / int4 (asymmetric min/max, KIVI-style) and fp8 E4M3.

Every kept group of ``size`` consecutive components carries, per token, a 16-bit shift and a 16-bit
scale (IEEE half precision); those 32 bits count against the bit budget. The functions below are the
single definition of the quantizer: the bit allocator measures its errors with them and the codec
encodes with them, so predicted and achieved errors agree.

Shapes: ``x`` is ``[tokens, groups, size]`` float32; symbols come back as uint8 of the same shape
(int2: 0..3, int4: 0..15, fp8: the E4M3 bit pattern), shift and scale as float16 ``[tokens, groups]``.
"""

from __future__ import annotations

import torch

#: quantization type codes as stored in plans and containers
DROP, INT2, INT4, FP8 = 0, 1, 2, 3
TYPE_NAMES = {DROP: "drop", INT2: "int2", INT4: "int4", FP8: "fp8"}
TYPE_BITS = {DROP: 0, INT2: 2, INT4: 4, FP8: 8}
#: per-token side information of a kept group: fp16 shift + fp16 scale
PARAM_BITS = 32

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_HALF_MAX = 65504.0


def group_bits(size: int, qtype: int) -> int:
    """Bits one token spends on a group of ``size`` components of type ``qtype`` (side info included)."""
    return 0 if qtype == DROP else size * TYPE_BITS[qtype] + PARAM_BITS


def _half_up(x: torch.Tensor) -> torch.Tensor:
    """Round a non-negative float32 tensor to float16, upwards (so a scale never shrinks the range)."""
    h = x.clamp(max=_HALF_MAX).to(torch.float16)
    low = h.float() < x
    if bool(low.any()):
        h = torch.where(low, torch.nextafter(h, torch.full_like(h, torch.inf)), h)
    return h


def quantize(x: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [tokens, groups, size] -> (symbols uint8, shift fp16, scale fp16)."""
    if x.dtype != torch.float32:
        x = x.float()
    lo = x.amin(dim=-1)
    hi = x.amax(dim=-1)
    if qtype in (INT2, INT4):
        levels = (1 << TYPE_BITS[qtype]) - 1
        shift = lo.clamp(-_HALF_MAX, _HALF_MAX).to(torch.float16)
        scale = _half_up((hi - shift.float()).clamp(min=0) / levels)
        s = scale.float().unsqueeze(-1)
        q = torch.where(s > 0, (x - shift.float().unsqueeze(-1)) / torch.where(s > 0, s, 1.0), 0.0)
        sym = q.round_().clamp_(0, levels).to(torch.uint8)
        return sym, shift, scale
    if qtype == FP8:
        shift = ((hi + lo) * 0.5).clamp(-_HALF_MAX, _HALF_MAX).to(torch.float16)
        sh = shift.float()
        amp = torch.maximum(hi - sh, sh - lo).clamp(min=0)
        scale = _half_up(amp / FP8_MAX)
        s = scale.float().unsqueeze(-1)
        y = torch.where(s > 0, (x - sh.unsqueeze(-1)) / torch.where(s > 0, s, 1.0), 0.0)
        sym = y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return sym, shift, scale
    raise ValueError(f"cannot quantize with type {qtype}")


def dequantize(sym: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, qtype: int) -> torch.Tensor:
    """Inverse of :func:`quantize`: float32 ``[tokens, groups, size]``."""
    sh = shift.float().unsqueeze(-1)
    sc = scale.float().unsqueeze(-1)
    if qtype in (INT2, INT4):
        return sym.float() * sc + sh
    if qtype == FP8:
        y = sym.view(torch.float8_e4m3fn).float()
        return y * sc + sh
    raise ValueError(f"cannot dequantize type {qtype}")


def squared_error(x: torch.Tensor, qtype: int) -> torch.Tensor:
    """Summed squared error of quantizing each group: ``[groups]`` float64 (sums over tokens and size)."""
    if qtype == DROP:
        return x.double().square().sum(dim=(0, 2))
    sym, shift, scale = quantize(x, qtype)
    err = (dequantize(sym, shift, scale, qtype) - x).double()
    return err.square().sum(dim=(0, 2))
