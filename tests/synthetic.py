"""Synthetic KV-like rows with a known spectrum in a random rotation (never axis-aligned)."""

from __future__ import annotations

import torch

from kvtc import KVLayout, KVSlice


class LowRankSource:
    """Rows ``x = µ + z Qᵀ`` with z's standard deviations decaying geometrically and Q a random rotation."""

    def __init__(self, p: int, rank: int | None = None, decay: float = 1e-3, noise: float = 1e-4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.p = p
        self.rank = rank or p
        self.q, _ = torch.linalg.qr(torch.randn(p, self.rank, generator=g))
        self.sd = torch.logspace(0, torch.log10(torch.tensor(decay)).item(), self.rank) * 4.0
        self.mu = torch.randn(p, generator=g) * 2.0
        self.noise = noise
        self.gen = torch.Generator().manual_seed(seed + 1)

    def rows(self, n: int) -> torch.Tensor:
        z = torch.randn(n, self.rank, generator=self.gen) * self.sd
        return self.mu + z @ self.q.T + self.noise * torch.randn(n, self.p, generator=self.gen)


def make_slice(
    layout: KVLayout, keys_rows: torch.Tensor, values_rows: torch.Tensor, batch: int = 1, start: int = 0
) -> KVSlice:
    n = keys_rows.shape[0] // batch
    shape = (batch, n, len(layout.layers), len(layout.heads), layout.head_dim)
    dt = layout.torch_dtype
    pos = torch.arange(start, start + n).repeat(batch, 1)
    return KVSlice(layout, keys_rows.reshape(shape).to(dt), values_rows.reshape(shape).to(dt), pos)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).square().sum() / b.square().sum())
