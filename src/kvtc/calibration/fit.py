"""Fit a :class:`Calibration` from feature rows: PCA per kind and group, then one bit plan per target ratio.

Rows are ``[n, p]`` float tensors in the layout's feature order, keys pre-RoPE, attention sinks already
excluded (the model adapters take care of both). A *source* is a list of ``(key_rows, value_rows)`` chunks
or a function returning a fresh iterator of them (needed by the randomized PCA, which passes over the data
several times).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..errors import CalibrationError
from ..layout import KVLayout
from .artifact import KINDS, Calibration, ratio_key
from .dp import ErrorCurve, Plan, budget_for_ratio, error_curve, split_budget
from .pca import EXACT_MAX_FEATURES, CovarianceAccumulator, PCAResult, randomized_pca
from .recipe import DEFAULT_RATIOS, DEFAULT_SENSITIVITY_FLOOR, DEFAULT_VALUE_WEIGHT, STORED_HEADROOM, Recipe

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

    def split(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the ``m`` rows a reservoir of ``m`` would hold, the others): a reservoir of ``2m`` gives the same sample
        as one of ``m`` plus ``m`` rows disjoint from it."""
        assert self.rows is not None and self.keys is not None
        if self.rows.shape[0] <= m:
            return self.rows, self.rows[:0]
        first = torch.zeros(self.rows.shape[0], dtype=torch.bool)
        first[torch.topk(self.keys, m).indices] = True
        return self.rows[first], self.rows[~first]


def fit_calibration(
    layout: KVLayout,
    rows: Source,
    recipe: Recipe = Recipe(),
    *,
    feature_scale: Mapping[str, torch.Tensor] | None = None,
    rope: dict[str, Any] | None = None,
    model_id: str = "",
    corpus: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """PCA + DP for keys and values and every PCA group, as ``recipe`` says (its fitting fields: ratios,
    grouping, PCA, DP, value weight, seed). The basis is cut to the components some plan keeps.

    ``rows`` yields ``(key_rows, value_rows)`` pairs of ``[n, p]`` tensors (a list, or a function returning
    a fresh iterator). The exact PCA consumes it in one pass (so a model forward pass producing the rows
    runs once); the randomized PCA passes over it ``3 + power_iters`` times per kind and needs a function.

    Keys and values of each PCA group share one budget of ``2·16p/CR`` bits per token, split where
    ``err_K/E_K + value_weight·err_V/E_V`` (relative errors measured on the calibration rows) is least. The DP
    counts each candidate group's expected stored bits (its symbols' entropy on the calibration rows); each plan is
    then the largest whose sections, entropy coded as in a blob (fixed-step planes under their components'
    Gaussians), fit the ratio's budget less :data:`~kvtc.calibration.recipe.STORED_HEADROOM` on held-out rows
    (:func:`stored_plan`).

    ``feature_scale`` (ours): ``{"keys": [p], "values": [p]}`` positive scales (see :func:`sensitivity_scales`;
    :func:`~kvtc.integrations.hf_calibrate.calibrate_model` measures them when ``recipe.sensitivity="fisher"``;
    without them the fit is the paper's plain squared error whatever ``recipe.sensitivity`` says);
    the PCA and the DP then run on ``x ∘ scale``, so the squared error they minimise is weighted by
    ``scale²``, the loss's sensitivity to each feature; the energies and errors above are then weighted ones.

    ``rope`` (the model's RoPE spec), ``model_id`` and ``corpus`` (free-form notes) are stored as given.
    """
    if not isinstance(recipe, Recipe):
        raise CalibrationError(
            f"recipe must be a kvtc.calibration.Recipe, got {type(recipe).__name__}; "
            "e.g. fit_calibration(layout, rows, Recipe(ratios=(8, 16)))"
        )
    say = progress or (lambda _msg: None)
    p = layout.num_features
    ratios, dp_rows, value_weight, seed = recipe.ratios, recipe.dp_rows, recipe.value_weight, recipe.seed
    scales = _check_scales(feature_scale, p)
    if scales:
        rows = _scaled_source(rows, scales["keys"], scales["values"])
    cols = recipe.grouping.columns(layout)
    widest = max(c.numel() for c in cols)
    use_exact = recipe.method == "exact" or (recipe.method == "auto" and widest <= EXACT_MAX_FEATURES)
    if not use_exact and not callable(rows):
        raise CalibrationError("randomized PCA passes over the rows several times: pass a function returning them")
    # each plan's stored bits are measured on rows the DP did not see (as many again, disjoint)
    reservoirs = {kind: _Reservoir(dp_rows * 2, seed + i) for i, kind in enumerate(KINDS)}
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
        results = {kind: [acc.finalize(recipe.rank_cap) for acc in accs[kind]] for kind in KINDS}
    else:
        for pair in _iterate(rows):
            for kind, x in zip(KINDS, _check_pair(pair, p)):
                reservoirs[kind].update(x)
        for i, kind in enumerate(KINDS):
            results[kind] = []
            for g, c in enumerate(cols):
                say(f"{kind}: randomized PCA of group {g} (p={c.numel()})")
                sub = lambda c=c, i=i: (pr[i].to(device, torch.float32)[:, c.to(device)] for pr in _iterate(rows))
                results[kind].append(
                    randomized_pca(sub, c.numel(), recipe.rank_cap, recipe.power_iters, recipe.oversample, device, seed)
                )
    stats["seconds"]["pca"] = round(time.perf_counter() - t0, 3)
    pcas: dict[str, list[PCAResult]] = {}
    plans: dict[str, dict[str, list[Plan]]] = {ratio_key(r): {kind: [] for kind in KINDS} for r in ratios}
    stats["kv_split"] = {"mode": "joint", "value_weight": value_weight, "errors": "relative", "value_share": {}}
    t0 = time.perf_counter()
    for kind in KINDS:
        res = reservoirs[kind]
        if res.rows is None or res.rows.shape[0] < 2:
            raise CalibrationError("no calibration rows were given")
    dp_sample = {kind: reservoirs[kind].split(dp_rows) for kind in KINDS}
    keep = {kind: [0] * len(cols) for kind in KINDS}
    for g, c in enumerate(cols):
        curves: dict[str, ErrorCurve] = {}
        energy: dict[str, float] = {}
        resid: dict[str, float] = {}
        kept_rows: dict[str, torch.Tensor] = {}
        budgets = [budget_for_ratio(c.numel(), r) * (1 - STORED_HEADROOM) for r in ratios]
        for kind in KINDS:
            pca = results[kind][g]
            sample, held = dp_sample[kind]
            x = sample[:, c] - pca.mean
            coeffs = x @ pca.basis.T
            energy[kind] = max(float(x.double().square().sum()), 1e-30)
            resid[kind] = max(energy[kind] - float(coeffs.double().square().sum()), 0.0)
            say(f"{kind}: bit allocation table for group {g}")
            curves[kind] = error_curve(coeffs, 2 * max(budgets), recipe.sizes, recipe.types, rate="coded")
            # held-out rows: the DP's own rows would flatter its choices (each rung was picked where it was cheap)
            kept_rows[kind] = (held[:, c] - pca.mean) @ pca.basis.T if held.shape[0] >= 2 else coeffs
            del x, coeffs
        for r, budget in zip(ratios, budgets):
            bk, bv = split_budget(
                curves["keys"], curves["values"], 2 * budget, 1.0 / energy["keys"], value_weight / energy["values"]
            )
            stats["kv_split"]["value_share"].setdefault(ratio_key(r), []).append(round(bv / max(bk + bv, 1e-30), 4))
            for kind, b in (("keys", bk), ("values", bv)):
                # ``pca`` is the values' PCA here, for the keys too: their fixed-step planes are costed under the
                # values' spreads, as the shipped defaults were measured (docs/studies/keys-spreads.md)
                plan = stored_plan(
                    curves[kind], kept_rows[kind], b, eigenvalues=pca.eigenvalues, ratio_budget_bits=budget,
                    kv_split="joint",
                )  # fmt: skip
                plans[ratio_key(r)][kind].append(plan)
                keep[kind][g] = max(keep[kind][g], plan.kept_components)
                stats["predicted_relative_error"].setdefault(ratio_key(r), {}).setdefault(kind, []).append(
                    (plan.predicted_error + resid[kind]) / energy[kind]
                )
        del curves
    for kind in KINDS:
        pcas[kind] = [pca.truncate(max(k, 1)) for pca, k in zip(results[kind], keep[kind])]
        if scales:
            pcas[kind] = [
                dataclasses.replace(pca, scale=scales[kind][c].contiguous()) for pca, c in zip(pcas[kind], cols)
            ]
    stats["seconds"]["dp"] = round(time.perf_counter() - t0, 3)
    stats["samples"] = pcas["keys"][0].samples
    return Calibration(
        layout=layout,
        grouping=recipe.grouping,
        pcas=pcas,
        plans=plans,
        rope=rope,
        model_id=model_id,
        corpus=corpus or {},
        stats=stats,
    )


def stored_bits(
    coeffs: torch.Tensor, plan: Plan, backend: str | None = None, eigenvalues: torch.Tensor | None = None
) -> float:
    """Bits per row that ``plan``'s sections take for the coefficient rows ``coeffs`` ``[n, k]`` as the CPU codec
    stores them: quantized and packed by :class:`kvtc.coding.quantizer.Quantizer`, each section entropy coded by
    ``backend`` (default: the CPU codec's, zstd) or stored raw where that is smaller, as in a blob; with the PCA's
    ``eigenvalues``, each fixed-step plane also under its components' Gaussians (:mod:`kvtc.coding.gaussian`) where
    that is smaller, as the CPU encoder does."""
    from ..coding.clock import stage_clock
    from ..coding.entropy import DEFAULT_BACKEND, encode_stream
    from ..coding.quantizer import PlanLayout, Quantizer

    pl = PlanLayout.build(plan)
    if pl.kept_groups == 0 or coeffs.shape[0] == 0:
        return 0.0
    if eigenvalues is not None:
        pl.set_spreads(eigenvalues)
    x = coeffs[:, : pl.components].float().contiguous()
    sections = Quantizer(torch.device("cpu"), fused=False).encode("g", x, pl, "bits", stage_clock(None))
    total = sum(len(encode_stream(raw, backend or DEFAULT_BACKEND)[1]) for _, raw in sections if len(raw))
    return 8.0 * total / coeffs.shape[0]


def stored_plan(
    curve: ErrorCurve,
    coeffs: torch.Tensor,
    budget_bits: float,
    steps: int = 8,
    eigenvalues: torch.Tensor | None = None,
    **meta: Any,
) -> Plan:
    """The plan of the largest budget whose sections, as the codec stores them
    (:func:`stored_bits` on ``coeffs``: calibration rows the DP did not see; ``eigenvalues``: the PCA's, for the
    fixed-step planes' Gaussians), fit ``budget_bits``. The coded rate counts each component's own symbol
    entropy, while a blob's entropy coder has one table per section (a type's plane of every component it codes), so
    plans of many distributions (fixed-step groups above all) store more than the DP counts; this closes that gap by
    bisection over the budget, ``steps`` halvings of a bracket around it."""

    def fits(b: float) -> tuple[bool, Plan, float]:
        plan = curve.plan(b, **meta)
        s = stored_bits(coeffs, plan, eigenvalues=eigenvalues)
        return s <= budget_bits, plan, s

    ok, plan, s = fits(budget_bits)
    lo, hi = (budget_bits, budget_bits * 1.25) if ok else (budget_bits * 0.75, budget_bits)
    best = (plan, s) if ok else None
    while best is None:
        ok, plan, s = fits(lo)
        if ok:
            best = (plan, s)
        elif lo < 1.0:
            best = (plan, s)  # nothing kept fits: the empty plan
        else:
            hi, lo = lo, lo * 0.75
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        ok, plan, s = fits(mid)
        if ok:
            lo, best = mid, (plan, s)
        else:
            hi = mid
    plan, s = best
    return dataclasses.replace(plan, meta={**plan.meta, "rate": "stored", "stored_bits": round(s, 3),
                                           "target_bits": budget_bits})  # fmt: skip


def sensitivity_scales(
    sensitivity: Mapping[str, torch.Tensor], floor: float = DEFAULT_SENSITIVITY_FLOOR
) -> dict[str, torch.Tensor]:
    """Feature scales for :func:`fit_calibration` from per-feature sensitivities (mean squared gradients of
    the loss, ``{"keys": [p], "values": [p]}``, e.g. from
    :func:`kvtc.integrations.hf_calibrate.measure_sensitivity`).

    One weight per feature, normalised to mean 1 per kind (the budget split between keys and values stays on
    relative errors), raised to at least ``floor`` and returned as ``sqrt(weight)``.
    """
    if not floor > 0:
        raise CalibrationError(f"sensitivity floor must be positive, got {floor}")
    w = {}
    for kind in KINDS:
        t = sensitivity.get(kind)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise CalibrationError(f"sensitivity of {kind} must be a finite non-negative [p] tensor")
        w[kind] = t.double()
    if w["keys"].shape != w["values"].shape:
        raise CalibrationError("key and value sensitivities differ in length")
    means = {kind: float(w[kind].mean()) for kind in KINDS}
    if not all(m > 0 for m in means.values()):
        raise CalibrationError("sensitivities are all zero: the loss did not reach the cache (check the model)")
    return {kind: (w[kind] / means[kind]).clamp(min=floor).sqrt().float() for kind in KINDS}


def _check_scales(scales: Mapping[str, torch.Tensor] | None, p: int) -> dict[str, torch.Tensor] | None:
    if scales is None:
        return None
    out = {}
    for kind in KINDS:
        s = scales.get(kind) if hasattr(scales, "get") else None
        if (
            not isinstance(s, torch.Tensor)
            or s.shape != (p,)
            or not bool(torch.isfinite(s.float()).all())
            or not bool((s.float() >= torch.finfo(torch.float32).tiny).all())
        ):
            raise CalibrationError(
                f"feature_scale[{kind!r}] must be a positive finite [{p}] tensor, no value below float32's smallest "
                "normal"
            )
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


__all__ = [
    "DEFAULT_RATIOS",
    "DEFAULT_SENSITIVITY_FLOOR",
    "DEFAULT_VALUE_WEIGHT",
    "KINDS",
    "Recipe",
    "fit_calibration",
    "sensitivity_scales",
]
