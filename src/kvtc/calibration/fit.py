"""Fit a :class:`Calibration` from feature rows: PCA per kind and group, then one bit plan per target ratio.

Rows are ``[n, p]`` float tensors in the layout's feature order, keys pre-RoPE, attention sinks already
excluded (the model adapters take care of both). A *source* is a list of chunks or a function returning a
fresh iterator of chunks (needed by the randomized PCA, which passes over the data several times).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

import torch

from ..errors import CalibrationError
from ..layout import KVLayout, PCAGrouping
from .artifact import KINDS, Calibration, ratio_key
from .dp import DEFAULT_DP_ROWS, DEFAULT_SIZES, DEFAULT_TYPES, Plan, allocate_many, budget_for_ratio
from .pca import (
    DEFAULT_OVERSAMPLE,
    DEFAULT_POWER_ITERS,
    DEFAULT_RANK_CAP,
    EXACT_MAX_FEATURES,
    CovarianceAccumulator,
    PCAResult,
    randomized_pca,
)

#: the paper's ratios; one basis serves all of them
DEFAULT_RATIOS: tuple[float, ...] = (8, 16, 32, 64)

Source = Callable[[], Iterable[torch.Tensor]] | Sequence[torch.Tensor]


def _iterate(source: Source) -> Iterable[torch.Tensor]:
    return source() if callable(source) else source


class _Reservoir:
    """Uniform sample of ``m`` rows from a stream (priority sampling with a seeded generator)."""

    def __init__(self, m: int, seed: int):
        self.m = m
        self.gen = torch.Generator().manual_seed(seed)
        self.rows: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None

    def update(self, rows: torch.Tensor) -> None:
        rows = rows.detach().float().cpu()
        keys = torch.rand(rows.shape[0], generator=self.gen)
        if self.rows is not None:
            rows = torch.cat([self.rows, rows])
            keys = torch.cat([self.keys, keys])
        if rows.shape[0] > self.m:
            top = torch.topk(keys, self.m).indices.sort().values
            rows, keys = rows[top], keys[top]
        self.rows, self.keys = rows, keys


def fit_calibration(
    layout: KVLayout,
    keys: Source,
    values: Source,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    grouping: PCAGrouping = PCAGrouping(),
    rank_cap: int = DEFAULT_RANK_CAP,
    dp_rows: int = DEFAULT_DP_ROWS,
    method: str = "auto",
    power_iters: int = DEFAULT_POWER_ITERS,
    oversample: int = DEFAULT_OVERSAMPLE,
    sizes: Sequence[int] = DEFAULT_SIZES,
    types: Sequence[int] = DEFAULT_TYPES,
    rope: dict[str, Any] | None = None,
    model_id: str = "",
    corpus: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """PCA + DP for every kind and group. The basis is cut to the components some plan keeps."""
    say = progress or (lambda _msg: None)
    cols = grouping.columns(layout)
    p = layout.num_features
    pcas: dict[str, list[PCAResult]] = {}
    plans: dict[str, dict[str, list[Plan]]] = {ratio_key(r): {} for r in ratios}
    stats: dict[str, Any] = {"dp_rows": dp_rows, "seconds": {}, "predicted_relative_error": {}}
    for kind, source in (("keys", keys), ("values", values)):
        t0 = time.perf_counter()
        use_exact = method == "exact" or (method == "auto" and max(c.numel() for c in cols) <= EXACT_MAX_FEATURES)
        res = _Reservoir(dp_rows, seed)
        results: list[PCAResult]
        if use_exact:
            accs = [CovarianceAccumulator(c.numel(), device) for c in cols]
            n = 0
            for rows in _iterate(source):
                _check_rows(rows, p)
                rows = rows.to(device, torch.float32)
                for acc, c in zip(accs, cols):
                    acc.update(rows[:, c.to(rows.device)] if len(cols) > 1 else rows)
                res.update(rows)
                n += rows.shape[0]
                say(f"{kind}: {n} rows accumulated")
            results = [acc.finalize(rank_cap) for acc in accs]
        else:
            if not callable(source):
                raise CalibrationError("randomized PCA passes over the rows several times: pass a function")
            for rows in _iterate(source):
                _check_rows(rows, p)
                res.update(rows)
            results = []
            for g, c in enumerate(cols):
                say(f"{kind}: randomized PCA of group {g} (p={c.numel()})")
                sub = (lambda c=c: (r.to(device, torch.float32)[:, c.to(device)] for r in _iterate(source)))
                results.append(randomized_pca(sub, c.numel(), rank_cap, power_iters, oversample, device, seed))
        stats["seconds"][f"{kind}_pca"] = round(time.perf_counter() - t0, 3)
        if res.rows is None or res.rows.shape[0] < 2:
            raise CalibrationError("no calibration rows were given")
        t0 = time.perf_counter()
        keep = [0] * len(cols)
        for key in plans:
            plans[key][kind] = []
        for g, (pca, c) in enumerate(zip(results, cols)):
            x = res.rows[:, c] - pca.mean
            coeffs = x @ pca.basis.T
            energy = float(x.double().square().sum())
            resid = energy - float(coeffs.double().square().sum())
            say(f"{kind}: bit plans for group {g}")
            budgets = [budget_for_ratio(c.numel(), r) for r in ratios]
            for r, plan in zip(ratios, allocate_many(coeffs, budgets, sizes, types)):
                plans[ratio_key(r)][kind].append(plan)
                keep[g] = max(keep[g], plan.kept_components)
                stats["predicted_relative_error"].setdefault(ratio_key(r), {}).setdefault(kind, []).append(
                    (plan.predicted_error + max(resid, 0.0)) / max(energy, 1e-30)
                )
        pcas[kind] = [pca.truncate(max(k, 1)) for pca, k in zip(results, keep)]
        stats["seconds"][f"{kind}_dp"] = round(time.perf_counter() - t0, 3)
    stats["samples"] = pcas["keys"][0].samples
    return Calibration(
        layout=layout,
        grouping=grouping,
        pcas=pcas,
        plans=plans,
        rope=rope,
        model_id=model_id,
        corpus=corpus or {},
        stats=stats,
    )


def _check_rows(rows: torch.Tensor, p: int) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != p:
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise CalibrationError(f"calibration rows must be [n, {p}] tensors, got {shape}")


__all__ = ["DEFAULT_RATIOS", "KINDS", "fit_calibration"]
