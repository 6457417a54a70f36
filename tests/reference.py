"""A deliberately plain float64 reference of KVTC encode+decode for one plan (the test oracle).

Written independently of kvtc.codec: per-group Python loops, float64 arithmetic, the quantizer
semantics spelled out from ALGORITHM.md (fp16 shift and scale, scale rounded up so the range is covered) and,
for the scale-only types, from kvtc.quant's docstring (levels at (q - L/2)·scale, scale = 2·max|x|/L); for the
fixed-step types, q = clamp(round(x / step), -h, h) with the plan's step, no range parameters.
"""

from __future__ import annotations

import torch

from kvtc.calibration.dp import Plan
from kvtc.quant import DROP, FP8, FP8S, INT1S, INT2, INT2F, INT2S, INT3, INT3S, INT4, INT4F, INT4S, INT8F

F16_MAX = 65504.0


def _f16_up(x: torch.Tensor) -> torch.Tensor:
    h = x.clamp(max=F16_MAX).to(torch.float16).double()
    nxt = torch.nextafter(h.to(torch.float16), torch.tensor(float("inf"), dtype=torch.float16)).double()
    return torch.where(h < x, nxt, h)


def quantize_dequantize(x: torch.Tensor, qtype: int, clip: float = 1.0) -> torch.Tensor:
    """x: [tokens, size] float64 -> reconstruction, float64. ``clip``: the encoder's clip of a scale-only int group,
    or a fixed-step group's step."""
    if qtype in (INT2F, INT4F, INT8F):
        half = {INT2F: 1, INT4F: 7, INT8F: 127}[qtype]
        step = float(torch.tensor(clip, dtype=torch.float32))
        return (x / step).round().clamp(-half, half) * step
    lo = x.min(dim=1).values
    hi = x.max(dim=1).values
    if qtype in (INT1S, INT2S, INT3S, INT4S):
        levels = {INT1S: 1, INT2S: 3, INT3S: 7, INT4S: 15}[qtype]
        scale = _f16_up(torch.maximum(-lo, hi).clamp(min=0) * clip * 2 / levels)
        q = torch.zeros_like(x)
        ok = scale > 0
        q[ok] = (x[ok] / scale[ok, None] + levels / 2).round().clamp(0, levels)
        return (q - levels / 2) * scale[:, None]
    if qtype == FP8S:
        scale = _f16_up(torch.maximum(-lo, hi).clamp(min=0) / 448.0)
        y = torch.zeros_like(x)
        ok = scale > 0
        y[ok] = (x[ok] / scale[ok, None]).clamp(-448, 448)
        return y.float().to(torch.float8_e4m3fn).double() * scale[:, None]
    if qtype in (INT2, INT3, INT4):
        levels = {INT2: 3, INT3: 7, INT4: 15}[qtype]
        shift = lo.clamp(-F16_MAX, F16_MAX).to(torch.float16).double()
        scale = _f16_up((hi - shift).clamp(min=0) / levels)
        q = torch.zeros_like(x)
        ok = scale > 0
        q[ok] = ((x[ok] - shift[ok, None]) / scale[ok, None]).round().clamp(0, levels)
        return q * scale[:, None] + shift[:, None]
    if qtype == FP8:
        shift = ((hi + lo) / 2).clamp(-F16_MAX, F16_MAX).to(torch.float16).double()
        amp = torch.maximum(hi - shift, shift - lo).clamp(min=0)
        scale = _f16_up(amp / 448.0)
        y = torch.zeros_like(x)
        ok = scale > 0
        y[ok] = ((x[ok] - shift[ok, None]) / scale[ok, None]).clamp(-448, 448)
        y = y.float().to(torch.float8_e4m3fn).double()
        return y * scale[:, None] + shift[:, None]
    raise ValueError(qtype)


def roundtrip(rows: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, plan: Plan) -> torch.Tensor:
    """rows [n, p] -> reconstruction [n, p], float64 throughout."""
    x = rows.double()
    b = basis.double()
    d = (x - mean.double()) @ b.T
    dhat = torch.zeros_like(d)
    clips = iter(plan.kept_clips())
    for start, size, qtype in plan.groups():
        if qtype == DROP:
            continue
        dhat[:, start : start + size] = quantize_dequantize(d[:, start : start + size], qtype, next(clips))
    return dhat @ b + mean.double()
