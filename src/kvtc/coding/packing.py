"""Component-major symbol planes and their packing into bytes.

A plane holds one PCA component's symbols for every coded token, contiguous; planes of one quantization
type follow each other in component order. Interleaving components token by token made every entropy
coder's output larger than plain bit packing (ALGORITHM.md), hence component-major.

Packing modes (the container records which one a stream used):

* ``bits``: int2 symbols 4 per byte, int4 symbols 2 per byte, low bits first; each plane is padded to a
  whole byte so planes start on byte boundaries. fp8 symbols are already bytes.
* ``bytes``: one symbol per byte.

``bits`` is the default: measured on real SmolLM2 KV it compresses better before zstd and zlib
(see docs/studies/packing.md).
"""

from __future__ import annotations

import torch

PACKINGS = ("bits", "bytes")


def symbols_per_byte(bits: int, packing: str) -> int:
    if packing == "bytes" or bits == 8:
        return 1
    return 8 // bits


def packed_plane_bytes(tokens: int, bits: int, packing: str) -> int:
    """Bytes one plane of ``tokens`` symbols of ``bits`` bits occupies."""
    per = symbols_per_byte(bits, packing)
    return -(-tokens // per)


def pack(planes: torch.Tensor, bits: int, packing: str = "bits") -> torch.Tensor:
    """``planes`` uint8 ``[components, tokens]`` -> uint8 ``[components, packed_plane_bytes]``."""
    per = symbols_per_byte(bits, packing)
    if per == 1:
        return planes.contiguous()
    c, n = planes.shape
    pad = (-n) % per
    if pad:
        planes = torch.nn.functional.pad(planes, (0, pad))
    p = planes.reshape(c, -1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (p << shifts).sum(dim=-1).to(torch.uint8)


def unpack(packed: torch.Tensor, tokens: int, bits: int, packing: str = "bits") -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[components, tokens]``."""
    per = symbols_per_byte(bits, packing)
    if per == 1:
        return packed[:, :tokens]
    mask = (1 << bits) - 1
    shifts = torch.arange(per, dtype=torch.int32) * bits
    out = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & mask
    return out.reshape(packed.shape[0], -1)[:, :tokens].to(torch.uint8)
