"""Bit allocation by dynamic programming (KVTC §3, ALGORITHM.md step 5).

The components of a PCA basis are walked in order and cut into consecutive *groups*; each group gets a
size from ``sizes`` and a type from ``types`` (the paper's: dropped, int2, int4, fp8; by default also ours: int3
and the scale-only int2s/int3s/int4s/fp8s, see :mod:`kvtc.quant`). A kept group costs
``size * bits(type) + 16 * params(type)`` bits per token (its fp16 shift and scale, or scale alone, count). The objective is the squared
error *measured* by running the real quantizer (:mod:`kvtc.quant`) on calibration coefficient rows,
not an analytic model. Because the basis is orthonormal, that error equals the error in feature space
(plus the energy of components beyond the basis' rank, a constant for a given basis).

**(ours)** A group of size ``g`` starts at a multiple of ``g`` (aligned groups). This makes the error of
every candidate group computable in one vectorized pass per (size, type) — ``O(rows · k)`` instead of
``O(rows · k · g)`` — and the DP is exact over that plan space (tests check it against brute force).

**(ours) Coded rate.** With ``rate="coded"`` a candidate group costs the bits the entropy coder is expected to
store instead: each of its components' order-0 entropy of the symbols the quantizer gives on the calibration rows
(Miller-Madow corrected, at most the type's width), plus its fp16 range parameters at full width. A ratio's budget
then buys what a blob stores, not what it packs: with ``"nominal"`` (the paper's rule) the entropy coder's gain
comes on top, so a 16x target stores about 17.5x.

Table: ``best[j, b]`` = least error of coding components ``[0, j)`` with exactly ``b`` budget units,
``choice[j, b]`` the candidate that ended there. A unit is 2 bits (every nominal cost is even; 1 bit for coded
costs, rounded up) unless the budget would need more than ``max_columns`` units; then costs are rounded *up* to a
coarser unit, so a plan never exceeds its budget, at the price of exactness (recorded in the plan).

The plan space (sizes, type sets, the fixed-step ladder) and :class:`Plan` are in :mod:`kvtc.calibration.plan`
(re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CalibrationError
from ..quant import DROP, FIXED_TYPES, best_clips, clippable, coded_bits, error_and_bits, group_bits, squared_error
from .plan import (  # noqa: F401  (re-exported: the plan space is part of the allocator's interface)
    _VIRTUAL,
    DEFAULT_SIZES,
    DEFAULT_TYPES,
    FIXED_RUNGS,
    PAPER_TYPES,
    R9_TYPES,
    Plan,
    _run_length,
    fixed_ladder,
    real_type,
)

#: calibration rows on which errors are measured (ALGORITHM.md: 1,024 rows)
DEFAULT_DP_ROWS = 1024
#: widest budget axis before costs are coarsened
DEFAULT_MAX_COLUMNS = 1 << 16
#: what a candidate group costs: its packed bits (the paper's) or the bits the entropy coder is expected to store
RATES: tuple[str, ...] = ("nominal", "coded")


def candidate_errors(
    coeffs: torch.Tensor,
    sizes: Sequence[int] = DEFAULT_SIZES,
    types: Sequence[int] = DEFAULT_TYPES,
    clips: dict[tuple[int, int], torch.Tensor] | None = None,
    costs: dict[tuple[int, int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[tuple[int, int], torch.Tensor]]:
    """Measured errors of every candidate group.

    ``coeffs``: ``[rows, k]`` PCA coefficients. Returns the per-component error of dropping ``[k]`` and,
    per ``(size, type)``, the error of each aligned group ``[k // size]`` (float64). With ``clips`` (a dict to
    fill), a clippable candidate gets its best clip per aligned group (:func:`kvtc.quant.best_clips`), recorded
    there, and the error at that clip; without, every group is measured unclipped. With ``costs`` (a dict to
    fill), each aligned group's expected stored bits at that clip (:func:`kvtc.quant.coded_bits`) are recorded there.
    """
    if coeffs.dim() != 2:
        raise CalibrationError(f"coefficient rows must be [rows, k], got {tuple(coeffs.shape)}")
    coeffs = coeffs.float()
    n, k = coeffs.shape
    drop = coeffs.double().square().sum(0)
    errs: dict[tuple[int, int], torch.Tensor] = {}
    fixed = [t for t in types if t in FIXED_TYPES]
    if fixed:
        # no per-token side information: a fixed-step group of one component is as cheap as a larger one, and
        # every component chooses its own step (the rungs are separate candidates, their costs measured)
        x = coeffs.reshape(n, k, 1)
        ladder = fixed_ladder(coeffs)
        for t in fixed:
            for r, step in enumerate(ladder.tolist()):
                key = (1, _VIRTUAL + t * FIXED_RUNGS + r)
                if costs is not None:
                    errs[key], costs[key] = error_and_bits(x, t, step)
                else:
                    errs[key] = squared_error(x, t, step)
                if clips is not None:
                    clips[key] = torch.full((k,), step, dtype=torch.float32)
    for g in sizes:
        m = k // g
        if m == 0:
            continue
        x = coeffs[:, : m * g].reshape(n, m, g)
        for t in types:
            if t in FIXED_TYPES:
                continue
            if clips is not None and clippable(t, g):
                clips[(g, t)], errs[(g, t)] = best_clips(x, t)
                if costs is not None:
                    costs[(g, t)] = coded_bits(x, t, clips[(g, t)])
            elif costs is not None:
                errs[(g, t)], costs[(g, t)] = error_and_bits(x, t)
            else:
                errs[(g, t)] = squared_error(x, t)
    return drop, errs


def _solve(
    drop: torch.Tensor,
    errs: dict[tuple[int, int], torch.Tensor],
    budget_bits: float,
    max_columns: int,
    costs: dict[tuple[int, int], torch.Tensor] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]], int, dict[tuple[int, int], np.ndarray]]:
    """Fill the DP table. Returns (last row of ``best``, ``choice``, candidates, unit, per-group costs in units
    (empty for nominal costs)). ``costs``: bits of each
    aligned group per ``(size, type)`` (coded rate); without, every group costs :func:`group_bits`."""
    k = drop.numel()
    base = 1 if costs is not None else 2
    unit = base
    if budget_bits / unit > max_columns:
        unit = base * math.ceil(budget_bits / (base * max_columns))
    cols = int(budget_bits // unit) + 1
    # candidate 0 is "drop one component"; a candidate's cost in units is one number or one per aligned group
    cands: list[tuple[int, int, int]] = [(1, DROP, 0)]
    units: dict[tuple[int, int], np.ndarray] = {}
    for g, t in errs:
        cands.append((g, t, math.ceil(group_bits(g, real_type(t)) / unit)))
        if costs is not None:
            units[(g, t)] = np.ceil(costs[(g, t)].double().cpu().numpy() / unit - 1e-9).astype(np.int64)
    _prune_fixed(errs, units, cands)
    ring = max(g for g, _, _ in cands) + 1
    best = np.full((ring, cols), np.inf)
    best[0, 0] = 0.0
    choice = np.zeros((k + 1, cols), dtype=np.int16)
    drop_np = drop.double().numpy()
    errs_np = {key: v.double().numpy() for key, v in errs.items()}
    by_size: dict[int, list[int]] = {}
    for ci, (g, _, _) in enumerate(cands[1:], start=1):
        by_size.setdefault(g, []).append(ci)
    m = np.empty(cols)
    v = np.empty(cols)
    better = np.empty(cols, dtype=bool)
    for j in range(1, k + 1):
        # pairwise minimum over candidates: elementwise ops on the budget axis, no per-element Python
        np.add(best[(j - 1) % ring], drop_np[j - 1], out=m)
        arg = choice[j]
        arg[:] = 0
        for g, cis in by_size.items():
            if j % g:
                continue
            prev = best[(j - g) % ring]
            for ci in cis:
                _, t, cost = cands[ci]
                per = units.get((g, t))
                if per is not None:
                    cost = int(per[(j - g) // g])
                if cost >= cols:
                    continue
                e = errs_np[(g, t)][(j - g) // g]
                np.add(prev[: cols - cost], e, out=v[cost:])
                np.less(v[cost:], m[cost:], out=better[cost:])
                np.copyto(m[cost:], v[cost:], where=better[cost:])
                np.copyto(arg[cost:], ci, where=better[cost:])
        best[j % ring] = m
    return best[k % ring].copy(), choice, cands, unit, units


def _prune_fixed(
    errs: dict[tuple[int, int], torch.Tensor],
    units: dict[tuple[int, int], np.ndarray],
    cands: list[tuple[int, int, int]],
) -> None:
    """Keep, for each component, only the fixed-step rungs no other rung beats in both cost and error (the others
    get a cost past any budget, so the DP skips them): the table's work grows with the few that remain."""
    keys = [key for key in errs if key[1] >= _VIRTUAL]
    if len(keys) < 2:
        return
    if not units:  # nominal costs: one per candidate; give each rung its cost per component
        cost_of = {(g, t): c for g, t, c in cands}
        for key in keys:
            units[key] = np.full(errs[key].numel(), cost_of[key], dtype=np.int64)
    c = np.stack([units[key] for key in keys])  # [V, k]
    e = np.stack([errs[key].double().numpy() for key in keys])
    order = np.lexsort((e, c), axis=0)  # per component: by cost, then error
    es = np.take_along_axis(e, order, 0)
    # a rung survives if its error is below every cheaper (or equally cheap, earlier) rung's
    prev = np.minimum.accumulate(np.concatenate([np.full((1, e.shape[1]), np.inf), es[:-1]]), axis=0)
    keep_sorted = es < prev
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, 0)
    never = np.iinfo(np.int64).max // 4
    for i, key in enumerate(keys):
        units[key] = np.where(keep[i], units[key], never)


def _backtrack(
    choice: np.ndarray, cands: list[tuple[int, int, int]], b: int, units: dict[tuple[int, int], np.ndarray]
) -> list[tuple[int, int]]:
    j = choice.shape[0] - 1
    groups: list[tuple[int, int]] = []
    while j > 0:
        g, t, cost = cands[int(choice[j, b])]
        per = units.get((g, t)) if t != DROP else None
        if per is not None:
            cost = int(per[(j - g) // g])
        groups.append((g, t))
        j -= g
        b -= cost
    groups.reverse()
    return groups


def _check(coeffs: torch.Tensor, sizes: Sequence[int]) -> None:
    if coeffs.dim() != 2 or coeffs.shape[0] == 0 or coeffs.shape[1] == 0:
        raise CalibrationError(f"need non-empty [rows, k] coefficients, got {tuple(coeffs.shape)}")
    if 1 not in sizes:
        raise CalibrationError("group sizes must include 1 so that every component count is reachable")


@dataclass
class ErrorCurve:
    """One DP table solved up to a largest budget: the least error and its plan for *every* smaller budget.

    ``best[u]`` is the least measured error within ``u`` budget units (``unit`` bits each), ``at[u]`` the
    exact unit count that reaches it (the fewest such). One solve serves every target ratio of a
    calibration and the K/V budget split (:func:`split_budget`).
    """

    best: np.ndarray
    at: np.ndarray
    choice: np.ndarray = field(repr=False)
    cands: list[tuple[int, int, int]] = field(repr=False)
    unit: int
    rows: int
    clips: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    #: coded rate: each aligned group's cost in units and expected stored bits, per (size, type); empty: nominal
    group_units: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)
    coded: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def units(self, budget_bits: float) -> int:
        return int(min(budget_bits // self.unit, self.best.size - 1))

    def error(self, budget_bits: float) -> float:
        return float(self.best[self.units(budget_bits)])

    def plan(self, budget_bits: float, **meta: Any) -> Plan:
        b = int(self.at[self.units(budget_bits)])
        groups = _backtrack(self.choice, self.cands, b, self.group_units)
        segments = _run_length([(g, real_type(t)) for g, t in groups])
        clips, start, coded = [], 0, 0.0
        for g, t in groups:
            if t != DROP:
                clips.append(float(self.clips[(g, t)][start // g]) if (g, t) in self.clips else 1.0)
                coded += float(self.coded[(g, t)][start // g]) if self.coded else 0.0
            start += g
        if self.coded:
            meta = {"rate": "coded", "coded_bits": round(coded, 3), **meta}
        return Plan(
            segments,
            float(self.best[self.units(budget_bits)]),
            self.rows,
            exact=self.unit == (1 if self.coded else 2),
            meta={"budget_bits": budget_bits, "unit_bits": self.unit, **meta},
            clips=tuple(clips) if any(c != 1.0 for c in clips) else (),
        )


def error_curve(
    coeffs: torch.Tensor,
    max_budget_bits: float,
    sizes: Sequence[int] = DEFAULT_SIZES,
    types: Sequence[int] = DEFAULT_TYPES,
    max_columns: int = DEFAULT_MAX_COLUMNS,
    rate: str = "nominal",
) -> ErrorCurve:
    """Solve the DP once for budgets up to ``max_budget_bits`` (see :class:`ErrorCurve`), each group costing its
    packed bits (``rate="nominal"``) or its expected stored bits (``"coded"``, see the module docstring)."""
    _check(coeffs, sizes)
    if rate not in RATES:
        raise CalibrationError(f"rate {rate!r} is not one of {', '.join(RATES)}")
    clips: dict[tuple[int, int], torch.Tensor] = {}
    coded: dict[tuple[int, int], torch.Tensor] | None = {} if rate == "coded" else None
    drop, errs = candidate_errors(coeffs, sizes, types, clips, coded)
    last, choice, cands, unit, units = _solve(drop, errs, max_budget_bits, max_columns, coded)
    best = np.minimum.accumulate(last)
    # first unit count reaching each new minimum (ties: fewer bits)
    prev = np.concatenate([[np.inf], best[:-1]])
    at = np.maximum.accumulate(np.where(last < prev, np.arange(last.size), 0))
    return ErrorCurve(best, at, choice, cands, unit, int(coeffs.shape[0]), clips, units, coded or {})


def split_budget(
    a: ErrorCurve, b: ErrorCurve, total_bits: float, weight_a: float = 1.0, weight_b: float = 1.0
) -> tuple[float, float]:
    """Bits for two error curves that share ``total_bits``, minimising ``weight_a·err_a + weight_b·err_b``.

    Exact over every split in budget units (both curves must use the same unit).
    """
    if a.unit != b.unit:
        raise CalibrationError(f"error curves with different budget units ({a.unit} vs {b.unit} bits)")
    total = int(total_bits // a.unit)
    ua = np.arange(total + 1)
    cost = (
        weight_a * a.best[np.minimum(ua, a.best.size - 1)] + weight_b * b.best[np.minimum(total - ua, b.best.size - 1)]
    )
    i = int(np.argmin(cost))
    return float(i * a.unit), float((total - i) * a.unit)


def allocate(coeffs: torch.Tensor, budget_bits: float, **options: Any) -> Plan:
    """Least measured error plan that spends at most ``budget_bits`` bits per token.

    ``coeffs``: ``[rows, k]`` PCA coefficients of calibration rows. For a target ratio ``CR`` on ``p``
    features stored in 16 bits the budget is ``16 * p / CR`` (see :func:`budget_for_ratio`). ``options``:
    ``sizes``, ``types`` and ``max_columns`` of :func:`error_curve`.
    """
    return allocate_many(coeffs, [budget_bits], **options)[0]


def allocate_many(coeffs: torch.Tensor, budgets_bits: Sequence[float], **options: Any) -> list[Plan]:
    """:func:`allocate` for several budgets from one DP table (solved for the largest budget)."""
    curve = error_curve(coeffs, max(budgets_bits), **options)
    return [curve.plan(b) for b in budgets_bits]


def allocate_for_error(
    coeffs: torch.Tensor,
    max_error: float,
    sizes: Sequence[int] = DEFAULT_SIZES,
    types: Sequence[int] = DEFAULT_TYPES,
    max_bits: float | None = None,
    max_columns: int = DEFAULT_MAX_COLUMNS,
    rate: str = "nominal",
) -> Plan:
    """Smallest plan (fewest bits per token) whose measured error is at most ``max_error``.

    ``max_bits`` bounds the search (default: ``16 * k``, i.e. no smaller than storing 16-bit values).
    Raises :class:`CalibrationError` when no plan within ``max_bits`` reaches the error.
    """
    max_bits = float(16 * coeffs.shape[-1] if max_bits is None else max_bits)
    curve = error_curve(coeffs, max_bits, sizes, types, max_columns, rate)
    ok = np.flatnonzero(curve.best <= max_error)
    if ok.size == 0:
        raise CalibrationError(
            f"no plan within {max_bits:.0f} bits per token reaches error {max_error:g} "
            f"(best {float(curve.best[-1]):g}); allow more bits or a larger error"
        )
    # the first budget whose least error is small enough: its plan uses exactly that many units
    return curve.plan(float(ok[0]) * curve.unit, max_error=max_error)


def budget_for_ratio(num_features: int, ratio: float, value_bits: int = 16) -> float:
    """Bits per token vector for a target compression ratio (paper: ``16 · p / CR``)."""
    if ratio <= 0:
        raise CalibrationError(f"compression ratio must be positive, got {ratio}")
    return value_bits * num_features / ratio
