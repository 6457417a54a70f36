"""A greedy bit allocator: the ablation that shows what the dynamic program of :mod:`kvtc.calibration.dp` buys.

Not used by the library. For one fixed group size, every aligned group starts dropped; the allocator
repeatedly takes the single upgrade of one group (to the next type in order of cost, e.g. dropped → int2 → int4
→ fp8, skipping a type that does not lower the error) with the largest measured error reduction per extra bit
that still fits the budget, until none fits. The errors are the same
measured ones the DP uses (:func:`~kvtc.calibration.dp.candidate_errors`, i.e. the real quantizer on
calibration coefficients). It is run for each group size in ``sizes`` and the least-error plan is kept.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..calibration import Calibration, Plan, budget_for_ratio, ratio_key
from ..calibration.dp import PAPER_TYPES, R9_TYPES, allocate, candidate_errors
from ..quant import DROP, group_bits

#: calibration rows: ``(key_rows, value_rows)`` chunks of ``[n, p]``, sinks excluded
Rows = Sequence[tuple[torch.Tensor, torch.Tensor]]

#: group sizes the greedy allocator tries (each on its own)
GREEDY_SIZES: tuple[int, ...] = (16, 64, 256)


def greedy_allocate(
    coeffs: torch.Tensor, budget_bits: float, sizes: Sequence[int] = GREEDY_SIZES, types: Sequence[int] = R9_TYPES
) -> Plan:
    """Greedy plan for ``coeffs [rows, k]`` (PCA coefficients) within ``budget_bits`` per token, at packed cost (the
    default types have a fixed cost per group: the fixed-step types, whose steps the DP chooses per component, are
    not the greedy's to use)."""
    k = coeffs.shape[1]
    drop, errs = candidate_errors(coeffs, sizes, types)
    drop = drop.double()
    best: Plan | None = None
    for g in sizes:
        m = k // g
        if m == 0:
            continue
        ladder = sorted(types, key=lambda t: group_bits(g, t))  # rising costs
        levels = [drop[: m * g].view(m, g).sum(1)] + [errs[(g, t)].double() for t in ladder]
        costs = [0] + [group_bits(g, t) for t in ladder]
        level = [0] * m
        spent = 0
        heap: list[tuple[float, int, int]] = []
        for i in range(m):
            _push_upgrade(heap, levels, costs, level, i)
        while heap:
            _, i, nxt = heapq.heappop(heap)
            extra = costs[nxt] - costs[level[i]]
            if spent + extra > budget_bits:
                continue
            spent += extra
            level[i] = nxt
            _push_upgrade(heap, levels, costs, level, i)
        error = sum(float(levels[level[i]][i]) for i in range(m)) + float(drop[m * g :].sum())
        groups = [(g, DROP if lv == 0 else ladder[lv - 1]) for lv in level]
        while groups and groups[-1][1] == DROP:
            groups.pop()
        segments: list[list[int]] = []
        for size, qtype in groups:
            if segments and segments[-1][1] == qtype:
                segments[-1][2] += 1
            else:
                segments.append([size, qtype, 1])
        plan = Plan(
            tuple(tuple(s) for s in segments),
            error,
            int(coeffs.shape[0]),
            exact=False,  # type: ignore[misc]
            meta={"allocator": "greedy", "size": g, "budget_bits": budget_bits},
        )
        if best is None or plan.predicted_error < best.predicted_error:
            best = plan
    if best is None:
        raise ValueError(f"no group size in {tuple(sizes)} fits {k} components")
    return best


def _push_upgrade(
    heap: list[tuple[float, int, int]], levels: Sequence[torch.Tensor], costs: Sequence[int], level: list[int], i: int
) -> None:
    """Queue group ``i``'s next upgrade that lowers its error (skipping a level is allowed when it does not), keyed
    by the error reduction per extra bit."""
    lv = level[i]
    for nxt in range(lv + 1, len(levels)):
        gain = float(levels[lv][i] - levels[nxt][i])
        if gain > 0:
            extra = costs[nxt] - costs[lv]  # 0 for a tie (int2 and int3s of 16 components): a free gain
            heapq.heappush(heap, (-gain / extra if extra > 0 else -math.inf, i, nxt))
            return


def greedy_calibration(calibration: Calibration, rows: Rows, ratios: Sequence[float], **kw: Any) -> Calibration:
    """``calibration``'s bases with greedy plans for ``ratios``, measured on up to ``max_rows`` of ``rows``
    (``(key_rows, value_rows)`` chunks of ``[n, p]``, sinks excluded). Each kind gets the bits the
    calibration's DP plan spends on it, so the ablation compares allocators at the same K/V split."""
    return replan(calibration, rows, ratios, greedy_allocate, "greedy", **kw)


def paper_types_calibration(calibration: Calibration, rows: Rows, ratios: Sequence[float], **kw: Any) -> Calibration:
    """``calibration``'s bases with DP plans restricted to the paper's quantization types (int2, int4, fp8 with
    min/max parameters), at the same bits per kind: the ablation of our int3 and scale-only types."""

    def dp_paper(coeffs: torch.Tensor, budget: float) -> Plan:
        return allocate(coeffs, budget, types=PAPER_TYPES)

    return replan(calibration, rows, ratios, dp_paper, "dp-paper-types", **kw)


def replan(
    calibration: Calibration,
    rows: Rows,
    ratios: Sequence[float],
    allocator: Callable[[torch.Tensor, float], Plan],
    name: str,
    max_rows: int = 1024,
    seed: int = 0,
) -> Calibration:
    """``calibration``'s bases with plans from ``allocator(coeffs, budget_bits)`` for ``ratios``, each kind given
    the bits the calibration's own plan spends on it (or the equal share where it has none)."""
    keys = torch.cat([k for k, _ in rows])
    values = torch.cat([v for _, v in rows])
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(keys.shape[0], generator=gen)[:max_rows]
    plans: dict[str, dict[str, list[Plan]]] = {ratio_key(r): {} for r in ratios}
    for kind, x in (("keys", keys[pick].float()), ("values", values[pick].float())):
        for r in ratios:
            plans[ratio_key(r)][kind] = []
        for g, cols in enumerate(calibration.columns):
            pca = calibration.pcas[kind][g]
            mean, basis = pca.coder_basis(decode=False)
            coeffs = (x[:, cols] - mean) @ basis.T
            for r in ratios:
                # the calibration's own plan's bits for this kind (after its K/V split), or the equal share
                own = calibration.plans.get(ratio_key(r), {}).get(kind)
                budget = own[g].bits_per_token if own else budget_for_ratio(cols.numel(), r)
                plans[ratio_key(r)][kind].append(allocator(coeffs, budget))
    return Calibration(
        calibration.layout,
        calibration.grouping,
        calibration.pcas,
        plans,
        calibration.rope,
        calibration.model_id,
        dict(calibration.corpus, allocator=name),
        dict(calibration.stats),
        token_map=calibration.token_map,  # the rows are the residuals of its map, as the codec codes them
    )
