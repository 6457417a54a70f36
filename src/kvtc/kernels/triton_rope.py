"""Fused Triton kernel: apply RoPE to pre-RoPE keys and lay them out as an engine's per-layer cache.

``keys`` ``[batch, tokens, layers, heads, head_dim]`` (any strides, last dim contiguous) becomes
``out`` ``[layers, batch, heads, tokens, head_dim]`` (contiguous: ``out[l]`` is a layer's ``[B, H, T, D]``),
each rotated pair computed in float32 exactly as :meth:`kvtc.rope.RopeSpec.apply` does (half-split pairs,
``x·cos − partner·sin`` with cos and sin already multiplied by the attention scaling), in one pass over the
keys instead of several full-size float32 temporaries. Layers of kind ``-1`` (no RoPE) are only copied.
``tests/test_gpu.py`` compares it with ``RopeSpec.apply``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32


class RopeTables:
    """:meth:`kvtc.rope.RopeSpec.head_tables`: float32 ``cos`` / ``sin`` ``[kinds, batch, tokens, rotary_dim / 2]`` and each
    layer's index into them (-1: no RoPE), made from one positions tensor on ``cos``'s device."""

    def __init__(
        self, cos: torch.Tensor, sin: torch.Tensor, index: dict[int, int], rotary_dim: int, positions: torch.Tensor
    ):
        self.cos, self.sin, self.index, self.rotary_dim = cos, sin, index, rotary_dim
        self.positions = positions  # the very tensor they were made from: fits() asks for it, not for its copy
        # each layer's own index tensor, made now: a per-layer call copies nothing to the device (no sync)
        self._one = {li: torch.tensor([i], dtype=torch.int32, device=cos.device) for li, i in index.items()}

    def fits(self, device: torch.device, positions: torch.Tensor, layers: tuple[int, ...]) -> bool:
        return positions is self.positions and device == self.cos.device and set(layers) <= set(self.index)

    def kinds(self, layers: tuple[int, ...]) -> torch.Tensor:
        if len(layers) == 1:
            return self._one[layers[0]]
        return torch.tensor([self.index[li] for li in layers], dtype=torch.int32, device=self.cos.device)


@triton.jit
def _rope_heads_kernel(
    x_ptr,
    sxb,
    sxt,
    sxl,
    sxh,
    cos_ptr,
    sin_ptr,
    sck,
    scb,
    sct,
    kind_ptr,
    out_ptr,
    B,
    H,
    T,
    D: tl.constexpr,
    HALF: tl.constexpr,
    R: tl.constexpr,
    BT: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # int64 offsets: a cache can hold more than 2^31 elements
    tb = tl.program_id(1).to(tl.int64)
    h = pid % H
    b = (pid // H) % B
    layer = pid // (H * B)
    kind = tl.load(kind_ptr + layer)
    t = tb * BT + tl.arange(0, BT).to(tl.int64)
    d = tl.arange(0, D)
    tmask = t < T
    m2 = tmask[:, None] & (d[None, :] < D)
    base = x_ptr + b * sxb + layer * sxl + h * sxh + t[:, None] * sxt
    x = tl.load(base + d[None, :], mask=m2, other=0.0).to(tl.float32)
    rotated = d < R
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    pmask = m2 & rotated[None, :]
    xp = tl.load(base + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
    ci = tl.where(first, d, d - HALF)
    turn = rotated & ((tl.zeros([D], dtype=tl.int32) + kind) >= 0)
    cmask = m2 & turn[None, :]
    kk = tl.maximum(kind, 0)
    cs = cos_ptr + kk * sck + b * scb + t[:, None] * sct + ci[None, :]
    c = tl.load(cs, mask=cmask, other=1.0)
    s = tl.load(sin_ptr + kk * sck + b * scb + t[:, None] * sct + ci[None, :], mask=cmask, other=0.0)
    sign = tl.where(first, -1.0, 1.0)
    y = x * c + (sign[None, :] * xp) * s
    y = tl.where(turn[None, :], y, x)
    o = out_ptr + (((layer * B + b) * H + h) * T + t[:, None]) * D + d[None, :]
    tl.store(o, y.to(out_ptr.dtype.element_ty), mask=m2)


def rope_to_heads(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kinds: torch.Tensor,
    rotary_dim: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``keys [B, T, L, H, D]`` -> rotated ``[L, B, H, T, D]`` in ``out_dtype``.

    ``cos`` / ``sin``: float32 ``[kinds, B, T, rotary_dim / 2]`` (attention scaling included); ``kinds``: int32
    ``[L]``, each layer's index into them or -1 for a layer without RoPE.
    """
    B, T, L, H, D = keys.shape
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if D & (D - 1) or rotary_dim % 2 or rotary_dim > D:
        raise ValueError(
            f"rope kernel needs a power-of-two head_dim and an even rotary dim <= it, got {D}, {rotary_dim}"
        )
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((L, B, H, T, D), dtype=out_dtype, device=keys.device)
    if out.numel() == 0:
        return out
    grid = (L * B * H, triton.cdiv(T, BLOCK_T))
    _rope_heads_kernel[grid](
        keys,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        keys.stride(3),
        cos,
        sin,
        cos.stride(0),
        cos.stride(1),
        cos.stride(2),
        kinds.to(device=keys.device, dtype=torch.int32).contiguous(),
        out,
        B,
        H,
        T,
        D=D,
        HALF=rotary_dim // 2,
        R=rotary_dim,
        BT=BLOCK_T,
    )
    return out


__all__ = ["rope_to_heads"]
