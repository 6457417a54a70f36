"""Fused Triton kernel: feature rows -> E4M3 operands of the fp8 projection, in one pass.

``x`` ``[batch, tokens, features]`` (any batch and token strides, features contiguous: e.g. the middle tokens of
every sequence of a KV slice, viewed in place) becomes ``out`` ``[batch · tokens, features]`` float8_e4m3fn,
``(x − mean) · inv`` per feature, saturated to ±448. With ``inv`` the reciprocal of each feature's spread (from
the calibration), the product's per-feature scales are folded into the basis, so no per-row scale pass is
needed (see :class:`kvtc.codec.transform.PCATransform`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _rows_to_fp8_kernel(
    x_ptr, sxb, sxt, tokens, rows, p, mean_ptr, inv_ptr, out_ptr, BR: tl.constexpr, BC: tl.constexpr
):
    r = tl.program_id(0) * BR + tl.arange(0, BR).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    rm = r < rows
    cm = c < p
    b = r // tokens
    i = r - b * tokens
    m = rm[:, None] & cm[None, :]
    v = tl.load(x_ptr + (b * sxb + i * sxt)[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
    mu = tl.load(mean_ptr + c, mask=cm, other=0.0)
    inv = tl.load(inv_ptr + c, mask=cm, other=0.0)
    y = (v - mu[None, :]) * inv[None, :]
    y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
    tl.store(out_ptr + r[:, None] * p + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def rows_to_fp8(x: torch.Tensor, mean: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, T, p]`` or ``[n, p]`` (last dim contiguous) -> float8_e4m3fn ``[B·T, p]`` of
    ``clamp((x − mean) · inv, ±448)``; ``mean`` and ``inv`` float32 ``[p]``."""
    if x.dim() == 2:
        x = x.unsqueeze(0)
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, T, p = x.shape
    out = torch.empty((B * T, p), dtype=torch.float8_e4m3fn, device=x.device)
    if out.numel():
        BR, BC = 32, 128
        grid = (triton.cdiv(B * T, BR), triton.cdiv(p, BC))
        _rows_to_fp8_kernel[grid](
            x,
            x.stride(0),
            x.stride(1),
            T,
            B * T,
            p,
            mean.contiguous(),
            inv.contiguous(),
            out,
            BR=BR,
            BC=BC,
            num_warps=4,
        )
    return out


__all__ = ["rows_to_fp8"]
