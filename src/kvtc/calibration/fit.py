"""Fit a :class:`Calibration` from feature rows: PCA per kind and group, then one bit plan per target ratio.

Rows are ``[n, p]`` float tensors in the layout's feature order, keys pre-RoPE, attention sinks already
excluded (the model adapters take care of both). A *source* is a list of ``(key_rows, value_rows)`` chunks
or a function returning a fresh iterator of them (needed by the randomized PCA, which passes over the data
several times).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..errors import CalibrationError
from ..layout import KVLayout, PCAGrouping
from .artifact import KINDS, Calibration, ratio_key
from .dp import DEFAULT_DP_ROWS, DEFAULT_SIZES, DEFAULT_TYPES, ErrorCurve, Plan, budget_for_ratio, error_curve, split_budget
from .pca import (
    DEFAULT_OVERSAMPLE,
    DEFAULT_POWER_ITERS,
    DEFAULT_RANK_CAP,
    EXACT_MAX_FEATURES,
    CovarianceAccumulator,
    PCAResult,
    randomized_pca,
)

#: target ratios of a calibration; one basis serves all of them (the paper's 8/16/32/64 and points between,
#: so that the quality-vs-bytes curve is dense where users choose: entropy coding stores about 1.12-1.15x
#: more, so the 7, 7.5 and 8 targets store about 7.9x, 8.4x and 9x)
DEFAULT_RATIOS: tuple[float, ...] = (6, 7, 7.5, 8, 10, 12, 16, 24, 32, 48, 64)
#: how a ratio's bits are divided between keys and values: "joint" (one budget of 2·16p/CR shared by K and V,
#: split to minimise the weighted relative errors; ours) or "equal" (16p/CR each)
KV_SPLITS = ("joint", "equal")
#: weight of the values' relative error against the keys' in the joint split. Measured on SmolLM2-135M
#: (BENCHMARKS.md, "K/V budget split"): value errors cost more next-token KL than key errors of the same
#: relative size, and weight 2 picks the split with the least KL at 8x and 16x.
DEFAULT_VALUE_WEIGHT = 2.0
#: sensitivity weights below this share of the mean are raised to it (a feature the loss barely feels still
#: gets some precision: the gradient is measured on a few windows and is noisy where it is small)
DEFAULT_SENSITIVITY_FLOOR = 0.01
#: how finely sensitivity weights are resolved: "head" (one per (layer, KV head), the mean of its dimensions) or
#: "feature" (one per feature)
SENSITIVITY_RESOLUTIONS = ("head", "feature")

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
    kv_split: str = "joint",
    value_weight: float = DEFAULT_VALUE_WEIGHT,
    feature_scale: Mapping[str, torch.Tensor] | None = None,
    split_errors: str = "relative",
) -> Calibration:
    """PCA + DP for keys and values and every PCA group. The basis is cut to the components some plan keeps.

    ``rows`` yields ``(key_rows, value_rows)`` pairs of ``[n, p]`` tensors (a list, or a function returning
    a fresh iterator). The exact PCA consumes it in one pass (so a model forward pass producing the rows
    runs once); the randomized PCA passes over it ``3 + power_iters`` times per kind and needs a function.

    ``kv_split``: ``"joint"`` gives keys and values of each PCA group one shared budget of ``2·16p/CR`` bits
    per token and splits it where ``err_K/E_K + value_weight·err_V/E_V`` (relative errors measured on the
    calibration rows) is least; ``"equal"`` gives each ``16p/CR`` (the paper's rule applied per kind).

    ``feature_scale`` (ours): ``{"keys": [p], "values": [p]}`` positive scales (see :func:`sensitivity_scales`);
    the PCA and the DP then run on ``x ∘ scale``, so the squared error they minimise is weighted by
    ``scale²``, the loss's sensitivity to each feature; the energies and errors above are then weighted ones.
    ``split_errors="weighted"`` splits on ``err_K + value_weight·err_V`` instead of relative errors (for scales
    that keep the loss's own K-vs-V proportion, ``sensitivity_scales(..., normalize="joint")``).
    """
    say = progress or (lambda _msg: None)
    p = layout.num_features
    scales = _check_scales(feature_scale, p)
    if split_errors not in ("relative", "weighted") or (split_errors == "weighted" and not scales):
        raise CalibrationError(f"split_errors must be 'relative' or, with feature_scale, 'weighted'; got {split_errors!r}")
    if scales:
        rows = _scaled_source(rows, scales["keys"], scales["values"])
    cols = grouping.columns(layout)
    use_exact = method == "exact" or (method == "auto" and max(c.numel() for c in cols) <= EXACT_MAX_FEATURES)
    if method not in ("auto", "exact", "randomized"):
        raise CalibrationError(f"unknown PCA method {method!r}; use 'exact', 'randomized' or 'auto'")
    if kv_split not in KV_SPLITS:
        raise CalibrationError(f"unknown K/V budget split {kv_split!r}; use one of {', '.join(KV_SPLITS)}")
    if not value_weight > 0:
        raise CalibrationError(f"value_weight must be positive, got {value_weight}")
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
    stats["kv_split"] = {"mode": kv_split, "value_weight": value_weight if kv_split == "joint" else None,
                         "errors": split_errors, "value_share": {}}
    t0 = time.perf_counter()
    for kind in KINDS:
        res = reservoirs[kind]
        if res.rows is None or res.rows.shape[0] < 2:
            raise CalibrationError("no calibration rows were given")
    keep = {kind: [0] * len(cols) for kind in KINDS}
    share = 2.0 if kv_split == "joint" else 1.0
    for g, c in enumerate(cols):
        curves: dict[str, ErrorCurve] = {}
        energy: dict[str, float] = {}
        resid: dict[str, float] = {}
        budgets = [budget_for_ratio(c.numel(), r) for r in ratios]
        for kind in KINDS:
            pca = results[kind][g]
            x = reservoirs[kind].rows[:, c] - pca.mean
            coeffs = x @ pca.basis.T
            energy[kind] = max(float(x.double().square().sum()), 1e-30)
            resid[kind] = max(energy[kind] - float(coeffs.double().square().sum()), 0.0)
            say(f"{kind}: bit allocation table for group {g}")
            curves[kind] = error_curve(coeffs, share * max(budgets), sizes, types)
            del x, coeffs
        for r, budget in zip(ratios, budgets):
            if kv_split == "joint" and split_errors == "weighted":
                bk, bv = split_budget(curves["keys"], curves["values"], 2 * budget, 1.0, value_weight)
            elif kv_split == "joint":
                bk, bv = split_budget(curves["keys"], curves["values"], 2 * budget,
                                      1.0 / energy["keys"], value_weight / energy["values"])
            else:
                bk = bv = budget
            stats["kv_split"]["value_share"].setdefault(ratio_key(r), []).append(round(bv / max(bk + bv, 1e-30), 4))
            for kind, b in (("keys", bk), ("values", bv)):
                plan = curves[kind].plan(b, ratio_budget_bits=budget, kv_split=kv_split)
                plans[ratio_key(r)][kind].append(plan)
                keep[kind][g] = max(keep[kind][g], plan.kept_components)
                stats["predicted_relative_error"].setdefault(ratio_key(r), {}).setdefault(kind, []).append(
                    (plan.predicted_error + resid[kind]) / energy[kind]
                )
        del curves
    for kind in KINDS:
        pcas[kind] = [pca.truncate(max(k, 1)) for pca, k in zip(results[kind], keep[kind])]
        if scales:
            pcas[kind] = [dataclasses.replace(pca, scale=scales[kind][c].contiguous()) for pca, c in zip(pcas[kind], cols)]
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


def sensitivity_scales(
    sensitivity: Mapping[str, torch.Tensor],
    resolution: str = "feature",
    floor: float = DEFAULT_SENSITIVITY_FLOOR,
    head_dim: int | None = None,
    normalize: str = "kind",
) -> dict[str, torch.Tensor]:
    """Feature scales for :func:`fit_calibration` from per-feature sensitivities (mean squared gradients of
    the loss, ``{"keys": [p], "values": [p]}``, e.g. from
    :func:`kvtc.integrations.hf_calibrate.measure_sensitivity`).

    Weights are averaged over each KV head's ``head_dim`` features when ``resolution="head"``, normalised to mean
    1 per kind (``normalize="kind"``: the budget split between keys and values stays on relative errors) or by
    one constant over keys and values (``"joint"``: the loss's own K-vs-V proportion, for
    ``split_errors="weighted"``), raised to at least ``floor`` and returned as ``sqrt(weight)``.
    """
    if normalize not in ("kind", "joint"):
        raise CalibrationError(f"normalize must be 'kind' or 'joint', got {normalize!r}")
    if resolution not in SENSITIVITY_RESOLUTIONS:
        raise CalibrationError(f"unknown sensitivity resolution {resolution!r}; use one of {SENSITIVITY_RESOLUTIONS}")
    if not floor > 0:
        raise CalibrationError(f"sensitivity floor must be positive, got {floor}")
    w = {}
    for kind in KINDS:
        t = sensitivity.get(kind)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise CalibrationError(f"sensitivity of {kind} must be a finite non-negative [p] tensor")
        t = t.double()
        if resolution == "head":
            if not head_dim or t.numel() % head_dim:
                raise CalibrationError(f"per-head sensitivity needs head_dim dividing p={t.numel()}")
            t = t.reshape(-1, head_dim).mean(1, keepdim=True).expand(-1, head_dim).reshape(-1)
        w[kind] = t
    if w["keys"].shape != w["values"].shape:
        raise CalibrationError("key and value sensitivities differ in length")
    means = {kind: float(w[kind].mean()) for kind in KINDS}
    if normalize == "joint":
        means = dict.fromkeys(KINDS, float(torch.cat([w["keys"], w["values"]]).mean()))
    if not all(m > 0 for m in means.values()):
        raise CalibrationError("sensitivities are all zero: the loss did not reach the cache (check the model)")
    return {kind: (w[kind] / means[kind]).clamp(min=floor).sqrt().float() for kind in KINDS}


def _check_scales(scales: Mapping[str, torch.Tensor] | None, p: int) -> dict[str, torch.Tensor] | None:
    if scales is None:
        return None
    out = {}
    for kind in KINDS:
        s = scales.get(kind) if hasattr(scales, "get") else None
        if not isinstance(s, torch.Tensor) or s.shape != (p,) or not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise CalibrationError(f"feature_scale[{kind!r}] must be a positive finite [{p}] tensor")
        out[kind] = s.detach().float().cpu()
    return out


def _scaled_source(rows: Source, sk: torch.Tensor, sv: torch.Tensor) -> Source:
    def gen(it: Iterable[Any]) -> Iterable[Any]:
        for pair in it:
            if isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair):
                k, v = pair
                yield (k.float() * sk.to(k.device), v.float() * sv.to(v.device))
            else:
                yield pair  # _check_pair names the problem

    if callable(rows):
        return lambda: gen(rows())
    return gen(rows)  # type: ignore[return-value]  # one lazy pass: rows stream, memory stays O(p²)


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


__all__ = ["DEFAULT_RATIOS", "DEFAULT_SENSITIVITY_FLOOR", "DEFAULT_VALUE_WEIGHT", "KINDS", "KV_SPLITS",
           "fit_calibration", "sensitivity_scales"]
