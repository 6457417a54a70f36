"""Fit a :class:`Calibration` from feature rows: PCA per kind and group, then one bit plan per target ratio.

Rows are ``[n, p]`` float tensors in the layout's feature order, keys pre-RoPE, attention sinks already
excluded (the model adapters take care of both). A *source* is a list of ``(key_rows, value_rows)`` chunks
or a function returning a fresh iterator of them (needed by the randomized PCA, which passes over the data
several times).
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
    rows: Source,
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
    """PCA + DP for keys and values and every PCA group. The basis is cut to the components some plan keeps.

    ``rows`` yields ``(key_rows, value_rows)`` pairs of ``[n, p]`` tensors (a list, or a function returning
    a fresh iterator). The exact PCA consumes it in one pass (so a model forward pass producing the rows
    runs once); the randomized PCA passes over it ``3 + power_iters`` times per kind and needs a function.
    """
    say = progress or (lambda _msg: None)
    cols = grouping.columns(layout)
    p = layout.num_features
    use_exact = method == "exact" or (method == "auto" and max(c.numel() for c in cols) <= EXACT_MAX_FEATURES)
    if method not in ("auto", "exact", "randomized"):
        raise CalibrationError(f"unknown PCA method {method!r}; use 'exact', 'randomized' or 'auto'")
    if not use_exact and not callable(rows):
        raise CalibrationError("randomized PCA passes over the rows several times: pass a function returning them")
    reservoirs = {kind: _Reservoir(dp_rows, seed + i) for i, kind in enumerate(KINDS)}
    results: dict[str, list[PCAResult]] = {}
    stats: dict[str, Any] = {"dp_rows": dp_rows, "seconds": {}, "predicted_relative_error": {}}
    t0 = time.perf_counter()
    if use_exact:
        accs = {kind: [CovarianceAccumulator(c.numel(), device) for c in cols] for kind in KINDS}
        n = 0
        for pair in _iterate(rows):
            for kind, x in zip(KINDS, _check_pair(pair, p)):
                x = x.to(device, torch.float32)
                for acc, c in zip(accs[kind], cols):
                    acc.update(x if len(cols) == 1 else x[:, c.to(x.device)])
                reservoirs[kind].update(x)
            n += pair[0].shape[0]
            say(f"accumulated {n} rows")
        say("eigendecomposition")
        results = {kind: [acc.finalize(rank_cap) for acc in accs[kind]] for kind in KINDS}
    else:
        for pair in _iterate(rows):
            for kind, x in zip(KINDS, _check_pair(pair, p)):
                reservoirs[kind].update(x)
        for i, kind in enumerate(KINDS):
            results[kind] = []
            for g, c in enumerate(cols):
                say(f"{kind}: randomized PCA of group {g} (p={c.numel()})")
                sub = (lambda c=c, i=i: (pr[i].to(device, torch.float32)[:, c.to(device)] for pr in _iterate(rows)))
                results[kind].append(randomized_pca(sub, c.numel(), rank_cap, power_iters, oversample, device, seed))
    stats["seconds"]["pca"] = round(time.perf_counter() - t0, 3)
    pcas: dict[str, list[PCAResult]] = {}
    plans: dict[str, dict[str, list[Plan]]] = {ratio_key(r): {kind: [] for kind in KINDS} for r in ratios}
    t0 = time.perf_counter()
    for kind in KINDS:
        res = reservoirs[kind]
        if res.rows is None or res.rows.shape[0] < 2:
            raise CalibrationError("no calibration rows were given")
        keep = [0] * len(cols)
        for g, (pca, c) in enumerate(zip(results[kind], cols)):
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
        pcas[kind] = [pca.truncate(max(k, 1)) for pca, k in zip(results[kind], keep)]
    stats["seconds"]["dp"] = round(time.perf_counter() - t0, 3)
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


def _check_pair(pair: Any, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise CalibrationError("calibration rows must come as (key_rows, value_rows) pairs")
    k, v = pair
    _check_rows(k, p)
    _check_rows(v, p)
    if k.shape[0] != v.shape[0]:
        raise CalibrationError(f"key and value chunks differ in rows: {k.shape[0]} vs {v.shape[0]}")
    return k, v


def _check_rows(rows: torch.Tensor, p: int) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != p:
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise CalibrationError(f"calibration rows must be [n, {p}] tensors, got {shape}")


__all__ = ["DEFAULT_RATIOS", "KINDS", "fit_calibration"]
