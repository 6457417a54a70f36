"""PCA: orthonormal [k, p] bases, streaming equals batch, randomized matches exact on its top components."""

from __future__ import annotations

import torch

from kvtc.calibration.pca import CovarianceAccumulator, fit_pca
from synthetic import LowRankSource


def test_exact_streaming_pca_recovers_the_rotation():
    src = LowRankSource(p=96, rank=12, decay=0.05, noise=1e-3, seed=0)
    chunks = [src.rows(500) for _ in range(8)]
    res = fit_pca(chunks, 96, method="exact")
    assert res.basis.shape == (96, 96) and res.mean.shape == (96,)
    eye = res.basis @ res.basis.T
    assert torch.allclose(eye, torch.eye(96), atol=1e-5)
    assert bool((res.eigenvalues[:-1] >= res.eigenvalues[1:] - 1e-6).all())
    # the top-12 subspace is the generating one (not axis-aligned)
    top = res.basis[:12]
    overlap = torch.linalg.svdvals(top @ src.q).min()
    assert overlap > 0.999
    # streaming in chunks equals one big chunk
    acc = CovarianceAccumulator(96)
    acc.update(torch.cat(chunks))
    one = acc.finalize()
    assert torch.allclose(one.mean, res.mean, atol=1e-4)
    assert torch.allclose(one.eigenvalues[:12], res.eigenvalues[:12], rtol=1e-4)


def test_large_mean_does_not_destroy_small_variances():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, 8, generator=g) * torch.tensor([1e-2] * 8) + 1e3
    res = fit_pca([x[:2000], x[2000:]], 8, method="exact")
    assert torch.allclose(res.eigenvalues, torch.full((8,), 1e-4), rtol=0.25)


def test_randomized_matches_exact_top_components_and_rank_cap():
    src = LowRankSource(p=256, rank=40, decay=0.01, noise=1e-4, seed=2)
    chunks = [src.rows(400) for _ in range(6)]
    exact = fit_pca(chunks, 256, method="exact")
    rnd = fit_pca(lambda: iter(chunks), 256, rank_cap=32, method="randomized", oversample=16, power_iters=4)
    assert rnd.basis.shape == (32, 256)
    assert torch.allclose(rnd.basis @ rnd.basis.T, torch.eye(32), atol=1e-4)
    assert torch.allclose(rnd.eigenvalues, exact.eigenvalues[:32], rtol=1e-3)
    # same subspace (up to signs): projections onto each other's top components agree
    cos = (rnd.basis[:16] * exact.basis[:16]).sum(1).abs()
    assert bool((cos > 0.999).all())
    assert abs(rnd.total_variance - exact.total_variance) / exact.total_variance < 1e-4


def test_accumulated_covariance_equals_the_batch_covariance():
    """The upper-triangle panels, the float32 running sum and its folds into float64 give the covariance of all
    rows: an uneven width (panels of different sizes), more chunks than a fold holds and a partial last fold."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2100, 37, generator=g) @ torch.randn(37, 37, generator=g)) * 0.3 + 5.0
    acc = CovarianceAccumulator(37)
    for chunk in x.split(100):  # 21 chunks: two folds of 8, then 5 left for finalize
        acc.update(chunk)
    res = acc.finalize()
    cov = res.basis.double().T @ torch.diag(res.eigenvalues.double()) @ res.basis.double()
    ref = torch.cov(x.double().T, correction=0)
    assert (cov - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.allclose(res.mean.double(), x.double().mean(0), atol=1e-5)
    assert abs(res.total_variance - float(ref.trace())) <= 1e-6 * float(ref.trace())
