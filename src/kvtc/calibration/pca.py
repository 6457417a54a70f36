"""PCA of feature rows: exact (streamed covariance + eigh) or randomized (streamed subspace iteration).

Basis convention (everywhere in kvtc): ``basis`` is ``[k, p]``, rows are components sorted by decreasing
eigenvalue, orthonormal; encode is ``(x − µ) @ basisᵀ``, decode ``c @ basis + µ``.

Both paths stream over row chunks, so the calibration data never has to be in memory at once:

* exact (default for ``p ≤ 8192``): one pass accumulates a float64 covariance (rows are centred on a pivot
  taken from the first chunk before the outer product, to avoid cancellation when means are large), then
  ``eigh``. Memory ``O(p²)``.
* randomized (Halko, Martinsson & Tropp 2011; the paper's defaults: 8 power iterations, rank cap 10K):
  ``2 + power_iters`` passes over a re-iterable source; memory ``O(p · (rank + oversample))``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from ..errors import CalibrationError

#: paper defaults
DEFAULT_POWER_ITERS = 8
DEFAULT_RANK_CAP = 10_000
DEFAULT_OVERSAMPLE = 64
#: largest p for which the exact covariance path is the default
EXACT_MAX_FEATURES = 8192
#: largest p whose covariance is eigendecomposed in float64 (float32 above)
EIGH_FLOAT64_MAX = 2048

RowSource = Callable[[], Iterable[torch.Tensor]]


@dataclass
class PCAResult:
    """``mean [p]``, ``basis [k, p]`` (rows are components), ``eigenvalues [k]`` (descending),
    ``total_variance`` (trace of the covariance: the energy a full basis would capture), ``samples``.

    A fit returns a float32 basis; a :class:`~kvtc.calibration.artifact.Calibration` holds it rounded to float16
    (as its file stores it), so read it through :meth:`coder_basis` (float32) or take it ``.float()``.

    ``scale [p]`` (optional, positive): the PCA was fitted on sensitivity-weighted rows ``x ∘ scale``, so
    ``mean``, ``basis`` and ``eigenvalues`` live in that weighted space; a coder projects
    ``(x − mean/scale) @ (basis ∘ scale)ᵀ`` and reconstructs ``coeffs @ (basis / scale) + mean/scale``."""

    mean: torch.Tensor
    basis: torch.Tensor
    eigenvalues: torch.Tensor
    total_variance: float
    samples: int
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        p = self.mean.numel()
        if self.mean.dim() != 1 or self.basis.dim() != 2 or self.basis.shape[1] != p:
            raise CalibrationError(f"basis must be [k, {p}], got {tuple(self.basis.shape)}")
        if self.eigenvalues.shape != (self.basis.shape[0],):
            raise CalibrationError("eigenvalues must have one entry per basis row")
        if self.scale is not None and (
            self.scale.shape != (p,)
            or self.scale.dtype != torch.float32
            or not bool(torch.isfinite(self.scale).all())
            or not bool((self.scale >= torch.finfo(torch.float32).tiny).all())
        ):
            raise CalibrationError(f"feature scale must be [{p}] positive finite float32, none denormal")

    def truncate(self, k: int) -> PCAResult:
        return PCAResult(
            self.mean,
            self.basis[:k].contiguous(),
            self.eigenvalues[:k].clone(),
            self.total_variance,
            self.samples,
            self.scale,
        )

    def coder_basis(self, decode: bool, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, basis)`` in feature units for a coder, float32 on ``device`` (None: where they are):
        ``coeffs = (x − mean) @ basisᵀ`` with the encode basis, ``x̂ = coeffs @ basis + mean`` with the decode basis
        (the same matrix when unweighted). A calibration stores its basis as float16 (format versions 10 on): it is
        moved to ``device`` as such and taken to float32 there (exactly), so the coder's arithmetic is float32."""
        mean, basis = self.mean.to(device), self.basis.to(device).float()
        if self.scale is None:
            return mean, basis
        s = self.scale.to(device)
        return mean / s, (basis / s) if decode else (basis * s)


#: float32 chunk products summed in place this many times before they are added into the float64 total
FOLD_CHUNKS = 8
#: the symmetric product of a chunk is computed in this many row panels of its upper triangle (the diagonal
#: blocks and everything to their right): 36/64 of the full product's multiply-adds
GRAM_PANELS = 8


class CovarianceAccumulator:
    """Streaming mean and covariance of ``[rows, p]`` chunks (float64 accumulation).

    A chunk's centred rows ``c`` add ``cᵀc`` to a float32 running sum in place (one matrix product with beta = 1,
    upper triangle only, in :data:`GRAM_PANELS` panels), which is folded into the float64 total every
    :data:`FOLD_CHUNKS` chunks: on a 5,760-wide SmolLM2 calibration this takes half the time of a full float32
    product per chunk plus a float64 add (the old way), for the same float64 total to float32 rounding."""

    def __init__(self, p: int, device: torch.device | str = "cpu"):
        self.p = p
        self.device = torch.device(device)
        self.count = 0
        self.pivot: torch.Tensor | None = None
        self.sum = torch.zeros(p, dtype=torch.float64, device=self.device)
        self.outer = torch.zeros(p, p, dtype=torch.float64, device=self.device)  # upper triangle until finalize
        self._gram = torch.zeros(p, p, dtype=torch.float32, device=self.device)
        self._pending = 0
        bounds = [round(i * p / GRAM_PANELS) for i in range(GRAM_PANELS + 1)]
        self._panels = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]

    def update(self, rows: torch.Tensor) -> None:
        if rows.dim() != 2 or rows.shape[1] != self.p:
            raise CalibrationError(f"rows must be [n, {self.p}], got {tuple(rows.shape)}")
        if rows.shape[0] == 0:
            return
        rows = rows.to(self.device, torch.float32)
        if self.pivot is None:
            self.pivot = rows.mean(0)
        c = rows - self.pivot
        self.sum += c.sum(0, dtype=torch.float64)
        for lo, hi in self._panels:
            self._gram[lo:hi, lo:].addmm_(c[:, lo:hi].T, c[:, lo:])
        self._pending += 1
        if self._pending >= FOLD_CHUNKS:
            self._fold()
        self.count += rows.shape[0]

    def _fold(self) -> None:
        if self._pending:
            self.outer += self._gram
            self._gram.zero_()
            self._pending = 0

    def finalize(self, rank: int | None = None) -> PCAResult:
        """The PCA of every row so far. The accumulator's own float64 sums become the covariance in place and are
        released: a calibration's peak memory is two ``p x p`` matrices per kind less than it would otherwise be."""
        if self.count < 2 or self.pivot is None:
            raise CalibrationError("need at least 2 calibration rows for a PCA")
        d = self.sum / self.count
        self._fold()
        self._gram = torch.empty(0)
        cov, self.outer = self.outer, torch.empty(0)  # the upper triangle of the sums, float64
        cov.triu_()
        cov += cov.triu(1).T
        cov.div_(self.count).addr_(d, d, alpha=-1)
        total = float(torch.trace(cov).clamp(min=0))
        # float64 eigh of a 5,760-wide covariance takes minutes on 2 cores; float32 is ~2x faster and loses
        # accuracy only on the smallest components, which the bit plans drop or code coarsely anyway
        if self.p > EIGH_FLOAT64_MAX:
            cov = cov.float()
        evals, evecs = torch.linalg.eigh(cov)
        del cov
        order = torch.argsort(evals.double(), descending=True)
        k = self.p if rank is None else min(rank, self.p)
        order = order[:k]
        basis = evecs[:, order].T.contiguous().float()
        del evecs
        mean = (self.pivot.double() + d).float()
        return PCAResult(mean.cpu(), basis.cpu(), spectrum(evals.double()[order]), total, self.count)


def spectrum(evals: torch.Tensor) -> torch.Tensor:
    """float32 eigenvalues as a calibration stores them: negatives (rounding) and values below float32's smallest
    normal (which a reader refuses: :func:`~kvtc.calibration.validation.check_tensors`) are written as zero."""
    ev = evals.float().cpu().clamp(min=0)
    return torch.where(ev < torch.finfo(torch.float32).tiny, torch.zeros_like(ev), ev)


def _chunks(source: RowSource | Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    yield from (source() if callable(source) else source)


def randomized_pca(
    source: RowSource,
    p: int,
    rank: int,
    power_iters: int = DEFAULT_POWER_ITERS,
    oversample: int = DEFAULT_OVERSAMPLE,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PCAResult:
    """Top-``rank`` PCA by randomized subspace iteration on the (implicit) covariance.

    ``source()`` must return a fresh iterator over ``[n, p]`` row chunks each time it is called.
    """
    device = torch.device(device)
    rank = min(rank, p)
    width = min(p, rank + oversample)
    # pass 1: mean and trace
    n = 0
    s = torch.zeros(p, dtype=torch.float64, device=device)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for rows in _chunks(source):
        rows = rows.to(device, torch.float32)
        n += rows.shape[0]
        s += rows.sum(0, dtype=torch.float64)
        sq += rows.double().square().sum()
    if n < 2:
        raise CalibrationError("need at least 2 calibration rows for a PCA")
    mean = (s / n).float()
    total = float(sq / n - (s / n).square().sum())

    def cov_times(q: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros(p, q.shape[1], dtype=torch.float64, device=device)
        for rows in _chunks(source):
            c = rows.to(device, torch.float32) - mean
            acc += (c.T @ (c @ q)).double()
        return (acc / n).float()

    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(p, width, generator=g).to(device)
    q, _ = torch.linalg.qr(cov_times(q))
    for _ in range(power_iters):
        q, _ = torch.linalg.qr(cov_times(q))
    t = q.T @ cov_times(q)
    t = 0.5 * (t + t.T)
    evals, evecs = torch.linalg.eigh(t.double())
    order = torch.argsort(evals, descending=True)[:rank]
    basis = (q.double() @ evecs[:, order]).T
    # re-orthonormalise in float64 (rows), keeps the [k, p] convention exact to fp32 rounding
    basis, _ = torch.linalg.qr(basis.T)
    basis = basis.T.float().contiguous()
    return PCAResult(mean.cpu(), basis.cpu(), spectrum(evals[order]), max(total, 0.0), n)


def fit_pca(
    source: RowSource | Iterable[torch.Tensor],
    p: int,
    rank_cap: int = DEFAULT_RANK_CAP,
    method: str = "auto",
    power_iters: int = DEFAULT_POWER_ITERS,
    oversample: int = DEFAULT_OVERSAMPLE,
    device: torch.device | str = "cpu",
) -> PCAResult:
    """PCA of the rows ``source`` yields; ``method`` is ``"exact"``, ``"randomized"`` or ``"auto"``."""
    if method == "auto":
        method = "exact" if p <= EXACT_MAX_FEATURES else "randomized"
    if method == "exact":
        acc = CovarianceAccumulator(p, device)
        for rows in _chunks(source):
            acc.update(rows)
        return acc.finalize(rank_cap)
    if method == "randomized":
        if not callable(source):
            raise CalibrationError("randomized PCA needs a re-iterable source: pass a function returning chunks")
        return randomized_pca(source, p, rank_cap, power_iters, oversample, device)
    raise CalibrationError(f"unknown PCA method {method!r}; use 'exact', 'randomized' or 'auto'")
