"""A realistic-spectrum KV source for the GPU benchmark: rows whose per-kind eigenvalue decay is a real model's.

``benchmarks/data/smollm2_spectrum.json`` holds the eigenvalues of the SmolLM2-135M-Instruct default
calibration (sensitivity-weighted PCA, rank 2,304 keys / 4,608 values of p = 5,760 features; what its DP allocates
bits from), written by ``python benchmarks/gpu_codec.py --write-spectrum CALIBRATION``. :func:`stretch` maps that
decay onto another feature count (component i of p' takes the eigenvalue at the same fraction i/p' of the source's
components, log-interpolated; the variance past the source's rank spread evenly), normalized to a mean variance of
one per feature. :class:`SpectrumSource` draws Gaussian rows with that spectrum in a random orthonormal basis (a
Hadamard matrix with random signs, dense in every feature) around a random mean: speed depends on the spectrum (how
many components the DP keeps), not on the directions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

SPECTRUM = Path(__file__).resolve().parent / "data" / "smollm2_spectrum.json"


def write_spectrum(calibration_path: str, out: Path = SPECTRUM) -> dict:
    from kvtc.calibration.artifact import Calibration

    cal = Calibration.load(calibration_path)
    d = {
        "source": f"{cal.model_id} default calibration (sensitivity-weighted PCA eigenvalues)",
        "p": cal.layout.num_features,
        "kept_at_16x": {k: [pl.kept_components for pl in cal.plans_for(16)[k]] for k in ("keys", "values")},
    }
    for kind in ("keys", "values"):
        pca = cal.pcas[kind][0]
        d[kind] = {
            "total_variance": float(pca.total_variance),
            "eigenvalues": [float(f"{x:.6g}") for x in pca.eigenvalues.tolist()],
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(d, separators=(",", ":")))
    return d


def stretch(eigenvalues: list[float], total: float, p_src: int, p: int) -> np.ndarray:
    """The decay of ``eigenvalues`` (of ``p_src`` features, ``total`` their trace) on ``p`` components, mean 1."""
    ev = np.asarray(eigenvalues, dtype=np.float64)
    full = np.empty(p_src)
    full[: len(ev)] = ev
    if p_src > len(ev):
        full[len(ev) :] = min(max(total - ev.sum(), 0.0) / (p_src - len(ev)), ev[-1])
    full = np.maximum(full, full.max() * 1e-12)
    u = (np.arange(p) + 0.5) * p_src / p - 0.5
    out = np.exp(np.interp(u, np.arange(p_src), np.log(full)))
    return out / out.mean()


class SpectrumSource:
    """Gaussian rows ``[n, p]`` (bfloat16, on the GPU) with a given eigenvalue spectrum per kind."""

    def __init__(self, p: int, spectra: dict[str, np.ndarray], seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        if p & (p - 1) == 0:
            h = torch.ones((1, 1), device="cuda", dtype=torch.bfloat16)
            while h.shape[0] < p:
                h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
            self.basis = h  # rows orthogonal, norm sqrt(p)
            self.norm = 1.0 / math.sqrt(p)
        else:
            q, _ = torch.linalg.qr(torch.randn(p, p, device="cuda", generator=g))
            self.basis, self.norm = q.to(torch.bfloat16), 1.0
        self.p = p
        self.g = g
        self.scale = {}
        self.mean = {}
        for kind, ev in spectra.items():
            signs = torch.randint(0, 2, (p,), device="cuda", generator=g) * 2 - 1
            self.scale[kind] = (torch.tensor(ev, device="cuda", dtype=torch.float32).sqrt() * signs * self.norm).to(
                torch.bfloat16
            )
            self.mean[kind] = (0.5 * torch.randn(p, device="cuda", generator=g)).to(torch.bfloat16)

    @torch.no_grad()
    def rows(self, kind: str, n: int, chunk: int = 8192) -> torch.Tensor:
        out = torch.empty((n, self.p), device="cuda", dtype=torch.bfloat16)
        for i in range(0, n, chunk):
            m = min(chunk, n - i)
            z = torch.randn((m, self.p), device="cuda", generator=self.g, dtype=torch.bfloat16) * self.scale[kind]
            torch.addmm(self.mean[kind], z, self.basis, out=out[i : i + m])
        return out


__all__ = ["SPECTRUM", "SpectrumSource", "stretch", "write_spectrum"]
