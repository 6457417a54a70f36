"""Quantizers of PCA coefficients: uniform integers (int1 / int2 / int3 / int4) and fp8 E4M3, each with per-token
range parameters, and fixed-step integers with none.

Two families of range parameters, per token and kept group of ``size`` consecutive components, in IEEE half
precision, counted against the bit budget:

* **min/max** (the paper's; KIVI-style asymmetric): a shift and a scale, 32 bits. int: ``x ≈ shift + q·scale``,
  ``q`` in ``0..2^b-1`` spanning the group's [min, max]; fp8: the shift is the range's midpoint and
  ``scale = half-range / 448``.
* **symmetric** (ours; types ``int1s``, ``int2s``, ``int3s``, ``int4s``, ``fp8s``): a scale only, 16 bits. PCA coefficients
  are centred, so the shift buys little for many groups, while its 16 bits are a large share of a small group.
  int: ``x ≈ (q - L/2)·scale`` with ``L = 2^b - 1`` and ``scale = 2·c·max|x| / L``: with the *clip* ``c = 1``
  the outer levels are ``±max|x|``; the encoder may clip (``c < 1``, from :data:`CLIPS`), saturating the few
  largest values of a group to spend its levels where most values are (for a group of 64 components at 2 bits
  this halves the error). The clip is the encoder's choice, made for each group of a plan by the DP on
  calibration rows and kept in the plan; a decoder needs only the scale. fp8: ``x ≈ e4m3(q)·scale`` with
  ``scale = max|x| / 448``. A group of one component in ``int2s`` (``c = 1``) stores its value to half precision
  (the sign in the symbol) in 18 bits.

**fixed-step** (ours; types ``int2f``, ``int4f``, ``int8f``): no per-token parameters at all. A group's step
comes from the plan (set at calibration time, one per group) and ``q = clamp(round(x / step), -h, h)`` is stored as
``q + h`` (``h`` = 1, 7, 127 in 2-, 4- and 8-bit planes), ``x ≈ q·step``: entropy-coded uniform scalar quantization.
Its bits are what the entropy coder makes of the symbols, so a component the step makes mostly zero costs a
fraction of a bit, and the DP chooses each component's step from a ladder by its measured cost and error
(:mod:`kvtc.calibration.dp`).

int3 (ours) fills the gap between int2 and int4, where the DP otherwise mixes the two. int1s (ours; in the DP's
default set since the coded rate) keeps a coefficient's sign, ``±c·max|x|`` (the best clip is near the group's mean ``|x|``):
1.25 bits a component in a group of 64, for tails the other types would drop. Which types a calibration
may use is the DP's choice (``kvtc.calibration.plan.DEFAULT_TYPES``; the paper's set is ``PAPER_TYPES``).

The functions below are the single definition of the quantizer: the bit allocator measures its errors with them
and the codec encodes with them (the GPU kernels reproduce them bit for bit), so predicted and achieved errors
agree. :func:`coded_bits` estimates what a group's symbols cost once entropy coded (the
bit allocator's ``rate="coded"``).

Shapes: ``x`` is ``[tokens, groups, size]`` float32; symbols come back as uint8 of the same shape
(intB: ``0..2^B-1``, fp8: the E4M3 bit pattern), shift and scale as float16 ``[tokens, groups]`` (a symmetric
type's shift is zero and is not stored).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

#: quantization type codes as stored in plans and containers (0-3: the paper's; 4-12: ours)
DROP, INT2, INT4, FP8, INT3, INT2S, INT3S, INT4S, FP8S, INT1S, INT2F, INT4F, INT8F = range(13)
TYPE_NAMES = {
    DROP: "drop",
    INT2: "int2",
    INT4: "int4",
    FP8: "fp8",
    INT3: "int3",
    INT2S: "int2s",
    INT3S: "int3s",
    INT4S: "int4s",
    FP8S: "fp8s",
    INT1S: "int1s",
    INT2F: "int2f",
    INT4F: "int4f",
    INT8F: "int8f",
}
TYPE_CODES = {name: code for code, name in TYPE_NAMES.items()}
TYPE_BITS = {
    DROP: 0, INT2: 2, INT4: 4, FP8: 8, INT3: 3, INT2S: 2, INT3S: 3, INT4S: 4, FP8S: 8, INT1S: 1, INT2F: 2, INT4F: 4,
    INT8F: 8,
}  # fmt: skip
#: the coded types in their stream order in a blob (the paper's types first: a blob that uses only them is laid
#: out as before ours existed)
CODED_TYPES = (INT2, INT4, FP8, INT3, INT2S, INT3S, INT4S, FP8S, INT1S, INT2F, INT4F, INT8F)
#: scale-only types (no per-token shift)
SYMMETRIC = frozenset({INT2S, INT3S, INT4S, FP8S, INT1S})
FP8_TYPES = frozenset({FP8, FP8S})
INT_TYPES = frozenset({INT2, INT3, INT4, INT2S, INT3S, INT4S, INT1S})
#: fixed-step types: no per-token range parameters; the step is the plan's (one per group, set at calibration)
#: and the symbol ``q + h`` of ``q = clamp(round(x / step), -h, h)`` is stored, ``h`` the type's half-width
FIXED_HALF = {INT2F: 1, INT4F: 7, INT8F: 127}
FIXED_TYPES = frozenset(FIXED_HALF)
#: bits of one per-token range parameter (fp16)
PARAM_BITS = 16


#: clips the DP tries for a scale-only int type (exact binary fractions: the CPU and GPU encoders compute
#: ``max|x|·c`` with the same rounding)
CLIPS = (1.0, 0.875, 0.75, 0.625, 0.5, 0.4375, 0.375, 0.3125, 0.25)


def fixed_step(qtype: int) -> bool:
    """Whether ``qtype`` is a fixed-step type (its groups carry a step from the plan instead of range parameters)."""
    return qtype in FIXED_TYPES


def clippable(qtype: int, size: int) -> bool:
    """Whether the encoder may clip groups of ``size`` components of ``qtype`` (scale-only int, size > 1)."""
    return qtype in SYMMETRIC and qtype != FP8S and size > 1


def param_rows(qtype: int) -> int:
    """Per-token fp16 range parameters of a kept group of ``qtype``: 2 (shift, scale), 1 (scale) or 0 (drop, or a
    fixed-step type)."""
    return 0 if qtype == DROP or qtype in FIXED_TYPES else 1 if qtype in SYMMETRIC else 2


FP8_MAX = 448.0  # largest finite float8_e4m3fn
_HALF_MAX = 65504.0


def group_bits(size: int, qtype: int) -> int:
    """Bits one token spends on a group of ``size`` components of type ``qtype`` (side info included)."""
    return size * TYPE_BITS[qtype] + PARAM_BITS * param_rows(qtype)


def _half_up(x: torch.Tensor) -> torch.Tensor:
    """Round a non-negative float32 tensor to float16, upwards (so a scale never shrinks the range)."""
    h = x.clamp(max=_HALF_MAX).to(torch.float16)
    low = h.float() < x
    if bool(low.any()):
        h = torch.where(low, torch.nextafter(h, torch.full_like(h, torch.inf)), h)
    return h


def quantize(
    x: torch.Tensor, qtype: int, clip: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [tokens, groups, size] -> (symbols uint8, shift fp16, scale fp16). ``clip``: one value or one
    per group (``[groups]`` float32), see the module docstring (scale-only int types only)."""
    if x.dtype != torch.float32:
        x = x.float()
    if qtype in FIXED_TYPES:
        return _quantize_fixed(x, qtype, clip)
    clipped = isinstance(clip, torch.Tensor) or clip != 1.0
    if clipped:
        c = torch.as_tensor(clip, dtype=torch.float32)
        if not clippable(qtype, x.shape[-1]) and bool((c != 1.0).any()):
            raise ValueError("clips need a scale-only int type and groups of more than one component")
        if not bool(((c > 0) & (c <= 1)).all()):
            raise ValueError("clips must lie in (0, 1]")
    lo = x.amin(dim=-1)
    hi = x.amax(dim=-1)
    if qtype in SYMMETRIC:
        amp = torch.maximum(-lo, hi).clamp(min=0)
        if clipped:
            amp = amp * c.to(amp.device)
        shift = torch.zeros_like(lo, dtype=torch.float16)
        if qtype == FP8S:
            scale = _half_up(amp / FP8_MAX)
        else:
            scale = _half_up((amp * 2) / ((1 << TYPE_BITS[qtype]) - 1))
    elif qtype in INT_TYPES:
        shift = lo.clamp(-_HALF_MAX, _HALF_MAX).to(torch.float16)
        scale = _half_up((hi - shift.float()).clamp(min=0) / ((1 << TYPE_BITS[qtype]) - 1))
    elif qtype == FP8:
        shift = ((hi + lo) * 0.5).clamp(-_HALF_MAX, _HALF_MAX).to(torch.float16)
        sh = shift.float()
        amp = torch.maximum(hi - sh, sh - lo).clamp(min=0)
        scale = _half_up(amp / FP8_MAX)
    else:
        raise ValueError(f"cannot quantize with type {qtype}")
    s = scale.float().unsqueeze(-1)
    pos = s > 0
    y = torch.where(pos, (x - shift.float().unsqueeze(-1)) / torch.where(pos, s, 1.0), 0.0)
    if qtype in FP8_TYPES:
        sym = y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return sym, shift, scale
    levels = (1 << TYPE_BITS[qtype]) - 1
    if qtype in SYMMETRIC:
        y = torch.where(pos, y + levels * 0.5, 0.0)
    sym = y.round_().clamp_(0, levels).to(torch.uint8)
    return sym, shift, scale


def _steps(step: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fixed-step type's step(s) as float32 ``[groups, 1]`` (or a scalar), checked positive and finite."""
    st = torch.as_tensor(step, dtype=torch.float32)
    if not bool(((st > 0) & torch.isfinite(st)).all()):
        raise ValueError("fixed-step steps must be positive and finite")
    return st.to(device).reshape(-1, 1) if st.dim() else st.to(device)


def _quantize_fixed(
    x: torch.Tensor, qtype: int, step: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    half = FIXED_HALF[qtype]
    q = torch.div(x, _steps(step, x.device)).round_().clamp_(-half, half)
    empty = torch.zeros(x.shape[:-1], dtype=torch.float16, device=x.device)
    return (q + half).to(torch.uint8), empty, empty


def dequantize(
    sym: torch.Tensor,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    qtype: int,
    step: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: float32 ``[tokens, groups, size]`` (``shift`` is ignored, and may be
    ``None``, for a symmetric type; a fixed-step type takes its ``step`` instead of ``shift`` and ``scale``: one, or
    one per group)."""
    if qtype in FIXED_TYPES:
        if step is None:
            raise ValueError("a fixed-step type dequantizes with its step")
        return (sym.float() - FIXED_HALF[qtype]) * _steps(step, sym.device)
    assert scale is not None
    sc = scale.float().unsqueeze(-1)
    if qtype in FP8_TYPES:
        val = sym.view(torch.float8_e4m3fn).float()
    elif qtype in INT_TYPES:
        val = sym.float()
    else:
        raise ValueError(f"cannot dequantize type {qtype}")
    if qtype in SYMMETRIC:
        if qtype != FP8S:
            val = val - ((1 << TYPE_BITS[qtype]) - 1) * 0.5
        return val * sc
    return val * sc + shift.float().unsqueeze(-1)  # type: ignore[union-attr]


def dequantize_numpy(
    sym: np.ndarray,
    shift: np.ndarray | None,
    scale: np.ndarray | None,
    qtype: int,
    step: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """:func:`dequantize` in numpy, the same float32 arithmetic step for step, so the same bits (``sym`` uint8
    ``[tokens, groups, size]``, ``shift``/``scale`` float16 ``[tokens, groups]``, ``step`` float32 ``[groups]`` or
    None for 1), computed in ``out`` (float32, ``sym``'s shape) when given. A CPU decode dequantizes a chunk of rows at
    a time with it: numpy runs each operation on the calling thread, where torch would start a parallel region per
    operation (thousands of them on a large decode, each a wait for the other threads where the machine's cores are
    busy)."""
    with np.errstate(all="ignore"):  # as torch: a corrupt scale (inf, NaN) gives inf/NaN values, never a warning
        return _dequantize_numpy(sym, shift, scale, qtype, step, out)


def _dequantize_numpy(sym, shift, scale, qtype, step, out):  # noqa: ANN001, ANN202 - see dequantize_numpy
    val = np.empty(sym.shape, dtype=np.float32) if out is None else out
    if qtype in FIXED_TYPES:
        val[...] = sym
        np.subtract(val, np.float32(FIXED_HALF[qtype]), out=val)
        st = np.float32(1.0) if step is None else np.asarray(step, dtype=np.float32).reshape(-1, 1)
        return np.multiply(val, st, out=val)
    assert scale is not None
    if qtype in FP8_TYPES:
        np.take(_fp8_values(), sym, out=val)
    elif qtype in INT_TYPES:
        val[...] = sym
    else:
        raise ValueError(f"cannot dequantize type {qtype}")
    if qtype in SYMMETRIC and qtype != FP8S:
        np.subtract(val, np.float32(((1 << TYPE_BITS[qtype]) - 1) * 0.5), out=val)
    np.multiply(val, scale[..., None], out=val)  # float16 operands are widened exactly: float32 products
    if qtype in SYMMETRIC:
        return val
    return np.add(val, shift[..., None], out=val)  # type: ignore[index]


@functools.cache
def _fp8_values() -> np.ndarray:
    """float32 ``[256]``: each E4M3 bit pattern's value, as torch converts it."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def squared_error(x: torch.Tensor, qtype: int, clip: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Summed squared error of quantizing each group: ``[groups]`` float64 (sums over tokens and size)."""
    if qtype == DROP:
        return x.double().square().sum(dim=(0, 2))
    return _squared_error(x, quantize(x, qtype, clip), qtype, clip)


def error_and_bits(x: torch.Tensor, qtype: int, clip: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`squared_error` and :func:`coded_bits` of the same groups from one quantization (the DP measures both
    for every candidate)."""
    q = quantize(x, qtype, clip)
    return _squared_error(x, q, qtype, clip), _entropy_bits(q[0], x.shape, qtype)


def _squared_error(
    x: torch.Tensor, q: tuple[torch.Tensor, ...], qtype: int, clip: float | torch.Tensor
) -> torch.Tensor:
    err = (dequantize(*q, qtype, clip) - x).double()
    return err.square_().sum(dim=(0, 2))


def best_clips(x: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each group of ``x`` [tokens, groups, size]: the clip of :data:`CLIPS` with the least summed squared
    error, and that error (``[groups]`` float32 clips, float64 errors; all 1.0 when the type cannot clip)."""
    errs = squared_error(x, qtype)
    clips = torch.ones(x.shape[1], dtype=torch.float32)
    if not clippable(qtype, x.shape[-1]):
        return clips, errs
    for c in CLIPS[1:]:
        e = squared_error(x, qtype, c)
        better = e < errs
        errs = torch.where(better, e, errs)
        clips[better] = c
    return clips, errs


def coded_bits(x: torch.Tensor, qtype: int, clip: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Expected stored bits per token of each group of ``x`` [rows, groups, size] quantized as ``qtype``: the
    summed order-0 entropy of each component's symbols over the rows (Miller-Madow corrected, at most the type's
    width) plus the group's fp16 range parameters at full width. ``[groups]`` float64."""
    return _entropy_bits(quantize(x, qtype, clip)[0], x.shape, qtype)


def _entropy_bits(sym: torch.Tensor, shape: torch.Size, qtype: int) -> torch.Tensor:
    n, m, g = shape
    levels = 256 if qtype in FP8_TYPES else 1 << TYPE_BITS[qtype]
    # the bin of symbol s of component c is c * levels + s (the rows' order does not matter to a count)
    dtype = torch.int32 if m * g * levels < 1 << 31 else torch.int64
    comp = torch.arange(m * g, dtype=dtype, device=sym.device) * levels
    idx = sym.reshape(n, m * g).to(dtype) + comp
    counts = torch.bincount(idx.reshape(-1), minlength=m * g * levels).reshape(m * g, levels).double()
    prob = counts / n
    h = -(prob * torch.where(counts > 0, prob, 1.0).log2()).sum(1)
    h = h + ((counts > 0).sum(1) - 1).double() / (2 * n * math.log(2))
    h = h.clamp(max=float(TYPE_BITS[qtype]))
    if qtype in FIXED_TYPES:
        # a byte-wise entropy coder spends at least one bit on each byte of a plane, 8 / bits symbols of this type
        h = h.clamp(min=TYPE_BITS[qtype] / 8)
    return h.reshape(m, g).sum(1) + PARAM_BITS * param_rows(qtype)
