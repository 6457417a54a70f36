"""Fused Triton kernels: quantize + pack, and unpack + dequantize, of one plan bucket.

They compute exactly what :func:`kvtc.quant.quantize` / :func:`kvtc.quant.dequantize` followed by
:func:`kvtc.coding.packing.pack` / :func:`kvtc.coding.packing.unpack` compute (those CPU functions are the
oracle; ``tests/test_gpu.py`` compares bit for bit): the same fp16 rounding of shift and scale (scale
rounded upwards), correctly rounded divisions, round-half-to-even, fp8 E4M3 with saturation, and an
unfused multiply then add on decode.

A *bucket* is every kept group of one (type, size) in a plan. One program handles ``BLOCK_T`` tokens of
``GPB`` groups (several groups per program when groups are small, one group walked in ``CH``-component
chunks when they are large). The group size is a runtime argument, not a compile-time one: the groups of 64 and
more components share one compiled kernel per type (the first encode or decode on a fresh machine compiles
3 kernels per type where it compiled 5, each without an unrolled walk over up to 1,024 components). Shapes:

* ``coeffs`` ``[n, k]`` (row-major, tokens by PCA components), float32 or bfloat16;
* ``params`` ``[rows, n]`` float16: each kept group's shift row then scale row, or its scale row alone for a
  scale-only type (``prow`` gives the group's first row);
* ``plane`` ``[components of the type, bytes per plane]`` uint8, component-major, tokens packed low bits
  first (``per`` symbols a byte), each plane padded with zero symbols to a whole byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import FIXED_HALF, FP8, FP8_MAX, FP8_TYPES, INT2, INT4, SYMMETRIC, TYPE_BITS

_HALF_MAX = 65504.0
#: the kernels' view of kvtc.quant.FP8_MAX (a Triton kernel reads only constexpr globals)
_FP8_MAX = tl.constexpr(FP8_MAX)
BLOCK_T = 64
#: components a program holds at once (groups are cut in chunks of this many, or packed this many a program)
TILE_C = 64


@triton.jit
def _div_rn(a, b):
    return tl.div_rn(a, b)


@triton.jit
def _rint(y):
    """Round half to even (``torch.round``)."""
    f = tl.floor(y)
    d = y - f
    even = (f - 2.0 * tl.floor(f * 0.5)) == 0.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(even, f, f + 1.0)))


@triton.jit
def _half_up(v):
    """fp16 of a non-negative float32, rounded upwards (``kvtc.quant._half_up``)."""
    h = tl.minimum(v, 65504.0).to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    up = (bits + 1).to(tl.float16, bitcast=True)
    return tl.where(h.to(tl.float32) < v, up, h)


@triton.jit
def _tile(col0_ptr, row0_ptr, prow_ptr, ngroups, n, GPB: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's tile: its groups (index, mask, first column, first plane row, params row; ``[GPB]``) and
    its tokens (index and mask; ``[BLOCK_T]``)."""
    gi = tl.program_id(0) * GPB + tl.arange(0, GPB)
    gmask = gi < ngroups
    col0 = tl.load(col0_ptr + gi, mask=gmask, other=0).to(tl.int64)
    row0 = tl.load(row0_ptr + gi, mask=gmask, other=0).to(tl.int64)
    prow = tl.load(prow_ptr + gi, mask=gmask, other=0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    return gi, gmask, col0, row0, prow, t, t < n


# fmt: off
@triton.jit
def _quantize_pack_kernel(
    x_ptr, stride_x, n, col0_ptr, row0_ptr, prow_ptr, ngroups, G, params_ptr, plane_ptr, plane_bytes, clip_ptr,
    IS_FP8: tl.constexpr, SYM: tl.constexpr, HAS_CLIP: tl.constexpr, LEVELS: tl.constexpr, BITS: tl.constexpr,
    PER: tl.constexpr, GPB: tl.constexpr, CH: tl.constexpr, BLOCK_T: tl.constexpr, FIXED: tl.constexpr,
    HALF: tl.constexpr
):
    pid_t = tl.program_id(1)
    gi, gmask, col0, row0, prow, t, tmask = _tile(col0_ptr, row0_ptr, prow_ptr, ngroups, n, GPB, BLOCK_T)
    c = tl.arange(0, CH)
    t3 = t.to(tl.int64)[:, None, None]
    m3 = tmask[:, None, None] & gmask[None, :, None]
    tb = pid_t * (BLOCK_T // PER) + tl.arange(0, BLOCK_T // PER)
    if FIXED:  # the plan's step per group; no range parameters
        if HAS_CLIP:
            step = tl.load(clip_ptr + gi, mask=gmask, other=1.0)
        else:
            step = tl.full((GPB,), 1.0, tl.float32)
        for k in range(0, G, CH):
            cols = col0[None, :, None] + k + c[None, None, :]
            v = tl.load(x_ptr + t3 * stride_x + cols, mask=m3, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(_rint(_div_rn(v, step[None, :, None])), -HALF * 1.0), HALF * 1.0)
            sym = (q + HALF).to(tl.int32)
            sym = tl.where(tmask[:, None, None], sym, 0)  # padding tokens are zero symbols
            sym = tl.reshape(sym, (BLOCK_T, GPB * CH))
            rows = tl.reshape(row0[:, None] + k + c[None, :], (GPB * CH,))
            rmask = tl.reshape(gmask[:, None] & (c[None, :] >= 0), (GPB * CH,))
            if PER == 1:
                optr = plane_ptr + rows[None, :] * plane_bytes + t.to(tl.int64)[:, None]
                tl.store(optr, sym.to(tl.uint8), mask=tmask[:, None] & rmask[None, :])
            else:
                sym = tl.reshape(sym, (BLOCK_T // PER, PER, GPB * CH))
                sh_bits = (tl.arange(0, PER) * BITS)[None, :, None]
                out = tl.sum(sym << sh_bits, axis=1)
                optr = plane_ptr + rows[None, :] * plane_bytes + tb.to(tl.int64)[:, None]
                tl.store(optr, out.to(tl.uint8), mask=(tb < plane_bytes)[:, None] & rmask[None, :])
    else:
        lo = tl.full((BLOCK_T, GPB), float("inf"), tl.float32)
        hi = tl.full((BLOCK_T, GPB), float("-inf"), tl.float32)
        for k in range(0, G, CH):
            cols = col0[None, :, None] + k + c[None, None, :]
            v = tl.load(x_ptr + t3 * stride_x + cols, mask=m3, other=0.0).to(tl.float32)
            lo = tl.minimum(lo, tl.min(v, axis=2))
            hi = tl.maximum(hi, tl.max(v, axis=2))

        if SYM:
            sh = tl.zeros((BLOCK_T, GPB), tl.float32)
            amp = tl.maximum(tl.maximum(-lo, hi), 0.0)
            if HAS_CLIP:
                amp = amp * tl.load(clip_ptr + gi, mask=gmask, other=1.0)[None, :]
            if IS_FP8:
                scale = _half_up(_div_rn(amp, _FP8_MAX))
            else:
                scale = _half_up(_div_rn(amp * 2.0, LEVELS * 1.0))
        elif IS_FP8:
            shift = (tl.minimum(tl.maximum((hi + lo) * 0.5, -65504.0), 65504.0)).to(tl.float16)
            sh = shift.to(tl.float32)
            amp = tl.maximum(tl.maximum(hi - sh, sh - lo), 0.0)
            scale = _half_up(_div_rn(amp, _FP8_MAX))
        else:
            shift = (tl.minimum(tl.maximum(lo, -65504.0), 65504.0)).to(tl.float16)
            sh = shift.to(tl.float32)
            scale = _half_up(_div_rn(tl.maximum(hi - sh, 0.0), LEVELS * 1.0))
        s = scale.to(tl.float32)
        pm = tmask[:, None] & gmask[None, :]
        pptr = params_ptr + prow[None, :] * n + t.to(tl.int64)[:, None]
        if SYM:
            tl.store(pptr, scale, mask=pm)
        else:
            tl.store(pptr, shift, mask=pm)
            tl.store(pptr + n, scale, mask=pm)

        pos = s > 0
        s_safe = tl.where(pos, s, 1.0)
        for k in range(0, G, CH):
            cols = col0[None, :, None] + k + c[None, None, :]
            v = tl.load(x_ptr + t3 * stride_x + cols, mask=m3, other=0.0).to(tl.float32)
            y = _div_rn(v - sh[:, :, None], s_safe[:, :, None])
            if SYM and not IS_FP8:
                y = y + LEVELS * 0.5
            y = tl.where(pos[:, :, None], y, 0.0)
            if IS_FP8:
                y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
                sym = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
            else:
                sym = tl.minimum(tl.maximum(_rint(y), 0.0), LEVELS * 1.0).to(tl.int32)
            sym = tl.where(tmask[:, None, None], sym, 0)  # padding tokens are zero symbols
            sym = tl.reshape(sym, (BLOCK_T, GPB * CH))
            rows = tl.reshape(row0[:, None] + k + c[None, :], (GPB * CH,))
            rmask = tl.reshape(gmask[:, None] & (c[None, :] >= 0), (GPB * CH,))
            if PER == 1:
                out = sym
                optr = plane_ptr + rows[None, :] * plane_bytes + t.to(tl.int64)[:, None]
                tl.store(optr, out.to(tl.uint8), mask=tmask[:, None] & rmask[None, :])
            else:
                sym = tl.reshape(sym, (BLOCK_T // PER, PER, GPB * CH))
                sh_bits = (tl.arange(0, PER) * BITS)[None, :, None]
                out = tl.sum(sym << sh_bits, axis=1)  # [T/PER, GPB*CH]
                optr = plane_ptr + rows[None, :] * plane_bytes + tb.to(tl.int64)[:, None]
                tl.store(optr, out.to(tl.uint8), mask=(tb < plane_bytes)[:, None] & rmask[None, :])
# fmt: on


# fmt: off
@triton.jit
def _unpack_dequantize_kernel(
    y_ptr, stride_y, n, col0_ptr, row0_ptr, prow_ptr, ngroups, G, params_ptr, plane_ptr, plane_bytes, cscale_ptr,
    step_ptr, IS_FP8: tl.constexpr, SYM: tl.constexpr, MASK: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
    GPB: tl.constexpr, CH: tl.constexpr, BLOCK_T: tl.constexpr, SCALE_OUT: tl.constexpr, FIXED: tl.constexpr,
    HAS_STEP: tl.constexpr, HALF: tl.constexpr
):
    pid_t = tl.program_id(1)
    gi, gmask, col0, row0, prow, t, tmask = _tile(col0_ptr, row0_ptr, prow_ptr, ngroups, n, GPB, BLOCK_T)
    c = tl.arange(0, CH)
    pm = tmask[:, None] & gmask[None, :]
    pptr = params_ptr + prow[None, :] * n + t.to(tl.int64)[:, None]
    if FIXED:
        sh = tl.zeros((BLOCK_T, GPB, 1), tl.float32)
        if HAS_STEP:
            st = tl.load(step_ptr + gi, mask=gmask, other=1.0)
        else:
            st = tl.full((GPB,), 1.0, tl.float32)
        sc = tl.zeros((BLOCK_T, GPB), tl.float32)[:, :, None] + st[None, :, None]
    elif SYM:
        sh = tl.zeros((BLOCK_T, GPB, 1), tl.float32)
        sc = tl.load(pptr, mask=pm, other=0.0).to(tl.float32)[:, :, None]
    else:
        sh = tl.load(pptr, mask=pm, other=0.0).to(tl.float32)[:, :, None]
        sc = tl.load(pptr + n, mask=pm, other=0.0).to(tl.float32)[:, :, None]
    tb = pid_t * (BLOCK_T // PER) + tl.arange(0, BLOCK_T // PER)
    for k in range(0, G, CH):
        rows = tl.reshape(row0[:, None] + k + c[None, :], (GPB * CH,))
        rmask = tl.reshape(gmask[:, None] & (c[None, :] >= 0), (GPB * CH,))
        if PER == 1:
            iptr = plane_ptr + rows[None, :] * plane_bytes + t.to(tl.int64)[:, None]
            b = tl.load(iptr, mask=tmask[:, None] & rmask[None, :], other=0)
            sym = b
        else:
            iptr = plane_ptr + rows[None, :] * plane_bytes + tb.to(tl.int64)[:, None]
            b = tl.load(iptr, mask=(tb < plane_bytes)[:, None] & rmask[None, :], other=0).to(tl.int32)
            sh_bits = (tl.arange(0, PER) * BITS)[None, :, None]
            sym = (b[:, None, :] >> sh_bits) & MASK  # [T/PER, PER, GPB*CH]
            sym = tl.reshape(sym, (BLOCK_T, GPB * CH))
        sym = tl.reshape(sym, (BLOCK_T, GPB, CH))
        if IS_FP8:
            val = sym.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            val = sym.to(tl.float32)
        # multiply, then add, each rounded (launched with fp fusion off): the CPU reference's arithmetic
        if FIXED:
            out = (val - HALF * 1.0) * sc
        elif SYM:
            if not IS_FP8:
                val = val - MASK * 0.5
            out = val * sc
        else:
            out = val * sc + sh
        cols = col0[None, :, None] + k + c[None, None, :]
        if SCALE_OUT:  # coefficients for an fp8 product: times a per-column factor, saturated to E4M3's range
            out = out * tl.load(cscale_ptr + cols, mask=gmask[None, :, None], other=0.0)
            out = tl.minimum(tl.maximum(out, -_FP8_MAX), _FP8_MAX)
        optr = y_ptr + t.to(tl.int64)[:, None, None] * stride_y + cols
        tl.store(optr, out.to(y_ptr.dtype.element_ty), mask=tmask[:, None, None] & gmask[None, :, None])
# fmt: on


def _shape(size: int) -> tuple[int, int]:
    """(groups per program, components per chunk) for groups of ``size`` components."""
    if size >= TILE_C:
        return 1, TILE_C
    return TILE_C // size, size


def _per(qtype: int, packing: str) -> int:
    bits = TYPE_BITS[qtype]
    return 1 if packing == "bytes" or bits == 8 else 8 // bits


# fmt: off
def _run(kernel, t: torch.Tensor, col0: torch.Tensor, row0: torch.Tensor, prow: torch.Tensor, qtype: int, size: int,
         params: torch.Tensor, plane: torch.Tensor, packing: str, extra: tuple, **consts) -> None:
    """Launch ``kernel`` over a bucket's groups and the rows of ``t`` ``[n, k]`` (the coefficients)."""
    n = t.shape[0]
    ngroups = col0.numel()
    if n == 0 or ngroups == 0:
        return
    assert t.stride(1) == 1 and params.is_contiguous() and plane.is_contiguous()
    gpb, ch = _shape(size)
    grid = (triton.cdiv(ngroups, gpb), triton.cdiv(n, BLOCK_T))
    kernel[grid](
        t, t.stride(0), n, col0, row0, prow, ngroups, size, params, plane, plane.shape[1], *extra,
        IS_FP8=qtype in FP8_TYPES, SYM=qtype in SYMMETRIC, BITS=TYPE_BITS[qtype], PER=_per(qtype, packing),
        GPB=gpb, CH=ch, BLOCK_T=BLOCK_T, FIXED=qtype in FIXED_HALF, HALF=FIXED_HALF.get(qtype, 0), num_warps=4,
        **consts,
    )


def quantize_pack(coeffs: torch.Tensor, col0: torch.Tensor, row0: torch.Tensor, prow: torch.Tensor, qtype: int,
                  size: int, params: torch.Tensor, plane: torch.Tensor, packing: str,
                  clips: torch.Tensor | None = None) -> None:
    """Quantize the groups starting at columns ``col0`` of ``coeffs`` and write their symbols into ``plane``
    (rows ``row0 + 0..size-1``) and their shift/scale into ``params`` (rows ``prow``). ``clips``: float32 per
    group (scale-only int types: the clip; fixed-step types: the step). In place."""
    _run(_quantize_pack_kernel, coeffs, col0, row0, prow, qtype, size, params, plane, packing,
         (clips if clips is not None else col0,), HAS_CLIP=clips is not None, LEVELS=(1 << TYPE_BITS[qtype]) - 1)


def unpack_dequantize(out: torch.Tensor, col0: torch.Tensor, row0: torch.Tensor, prow: torch.Tensor, qtype: int,
                      size: int, params: torch.Tensor, plane: torch.Tensor, packing: str,
                      col_scale: torch.Tensor | None = None, steps: torch.Tensor | None = None) -> None:
    """Inverse of :func:`quantize_pack`: write the dequantized groups into columns of ``out`` ``[n, k]``.
    ``col_scale``: float32 ``[k]``; each value is then multiplied by its column's factor and clamped to ±448 (an
    fp8 ``out``: coefficients ready for a scaled fp8 product, their scales folded into the basis). ``steps``:
    float32 per group, a fixed-step type's (None: 1; ignored by the other types)."""
    fixed = qtype in FIXED_HALF and steps is not None
    _run(_unpack_dequantize_kernel, out, col0, row0, prow, qtype, size, params, plane, packing,
         (col_scale if col_scale is not None else params, steps if fixed else params), MASK=(1 << TYPE_BITS[qtype]) - 1,
         SCALE_OUT=col_scale is not None, HAS_STEP=fixed, enable_fp_fusion=False)
# fmt: on


__all__ = ["quantize_pack", "unpack_dequantize", "INT2", "INT4", "FP8"]
