"""The DP bit allocator is optimal (vs exhaustive search) and its predictions equal measured errors."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvtc.calibration.dp import (
    Plan,
    allocate,
    allocate_for_error,
    allocate_many,
    budget_for_ratio,
    candidate_errors,
    error_curve,
    split_budget,
)
from kvtc.errors import CalibrationError
from kvtc.quant import DROP, FP8, INT2, INT4, dequantize, group_bits, quantize

SIZES = (1, 2, 4)
TYPES = (INT2, INT4, FP8)


def brute_force(coeffs: torch.Tensor, budget: float, coded: bool = False) -> float:
    """Least error over every aligned partition of the k components into typed groups, each group costing its
    packed bits or (``coded``) its expected stored bits rounded up to whole bits."""
    k = coeffs.shape[1]
    costs: dict = {}
    # each group at its best clip, as the DP
    drop, errs = candidate_errors(coeffs, SIZES, TYPES, clips={}, costs=costs if coded else None)
    best = math.inf

    def cost(g: int, t: int, j: int) -> int:
        return math.ceil(float(costs[(g, t)][j // g]) - 1e-9) if coded else group_bits(g, t)

    def rec(j: int, bits: int, err: float) -> None:
        nonlocal best
        if bits > budget:
            return
        if j == k:
            best = min(best, err)
            return
        rec(j + 1, bits, err + float(drop[j]))
        for g in SIZES:
            if j % g == 0 and j + g <= k:
                for t in TYPES:
                    rec(j + g, bits + cost(g, t, j), err + float(errs[(g, t)][j // g]))

    rec(0, 0, 0.0)
    return best


@pytest.mark.parametrize("rate", ["nominal", "coded"])
def test_dp_matches_exhaustive_search_on_random_instances(rate):
    coded = rate == "coded"
    rnd = random.Random(0)
    for trial in range(60):
        k = rnd.randint(1, 8)
        n = rnd.randint(2, 40 if coded else 12)
        scale = torch.tensor([rnd.uniform(0.01, 10) for _ in range(k)])
        gen = torch.Generator().manual_seed(trial)
        # coded: Laplacian rows, whose symbols are far from uniform, so coded and packed costs differ
        if coded:
            rows = torch.rand(n, k, generator=gen).sub(0.5).sign() * torch.rand(n, k, generator=gen).log().neg()
        else:
            rows = torch.randn(n, k, generator=gen)
        coeffs = rows * scale
        budget = rnd.randint(0, 40 * k)
        plan = allocate(coeffs, budget, sizes=SIZES, types=TYPES, rate=rate)
        want = brute_force(coeffs, budget, coded=coded)
        assert (plan.meta["coded_bits"] if coded else plan.bits_per_token) <= budget
        assert plan.predicted_error == pytest.approx(want, rel=1e-12, abs=1e-12), (trial, k, budget)
        # the plan's groups really give that error
        assert _measure(coeffs, plan) == pytest.approx(want, rel=1e-9, abs=1e-12)


def _measure(coeffs: torch.Tensor, plan: Plan) -> float:
    total = 0.0
    covered = 0
    clips = iter(plan.kept_clips())
    for start, size, t in plan.groups():
        x = coeffs[:, start : start + size].unsqueeze(1)
        if t == DROP:
            total += float(x.double().square().sum())
        else:
            clip = next(clips)
            sym, sh, sc = quantize(x, t, clip)
            total += float((dequantize(sym, sh, sc, t, clip) - x).double().square().sum())
        covered = start + size
    total += float(coeffs[:, covered:].double().square().sum())
    return total


def test_error_variant_gives_smallest_plan_meeting_the_error():
    rnd = random.Random(1)
    for trial in range(30):
        k = rnd.randint(1, 7)
        coeffs = torch.randn(8, k, generator=torch.Generator().manual_seed(100 + trial)) * torch.rand(k) * 5
        total = float(coeffs.double().square().sum())
        target = total * rnd.uniform(0.0005, 0.5)
        plan = allocate_for_error(coeffs, target, sizes=SIZES, types=TYPES, max_bits=40 * k)
        assert plan.predicted_error <= target
        # no budget below the plan's bits reaches the target
        if plan.bits_per_token > 0:
            cheaper = brute_force(coeffs, plan.bits_per_token - 1)
            assert cheaper > target


def test_error_variant_refuses_unreachable_error():
    coeffs = torch.randn(16, 4) * 3
    with pytest.raises(CalibrationError):
        allocate_for_error(coeffs, 0.0, sizes=SIZES, types=TYPES, max_bits=10)


def test_real_size_prediction_equals_measurement_and_budget_holds():
    k, n = 2048, 256
    coeffs = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * torch.logspace(1, -3, k)
    budgets = [budget_for_ratio(k, r) for r in (4, 16, 64)]
    plans = allocate_many(coeffs, budgets)
    errs = []
    for plan, budget in zip(plans, budgets):
        assert plan.bits_per_token <= budget
        assert plan.bits_per_token >= 0.95 * budget  # the budget is used, not wasted (64x: 496 of 512 bits)
        assert plan.exact
        assert _measure(coeffs, plan) == pytest.approx(plan.predicted_error, rel=1e-6)
        errs.append(plan.predicted_error)
    assert errs[0] < errs[1] < errs[2]
    # a larger budget spends the trailing components on nothing: they are cut from the plan
    assert plans[2].kept_components < plans[0].kept_components <= k


def test_one_table_gives_every_smaller_budget_its_own_optimum():
    """error_curve solved once for the largest budget = a separate solve per budget (brute force too)."""
    rnd = random.Random(5)
    for trial in range(20):
        k = rnd.randint(1, 7)
        coeffs = torch.randn(rnd.randint(2, 10), k, generator=torch.Generator().manual_seed(100 + trial))
        coeffs *= torch.tensor([rnd.uniform(0.01, 10) for _ in range(k)])
        top = rnd.randint(10, 40 * k)
        curve = error_curve(coeffs, top, sizes=SIZES, types=TYPES)
        for budget in sorted({rnd.randint(0, top) for _ in range(6)} | {top}):
            plan = curve.plan(budget)
            assert plan.bits_per_token <= budget
            assert plan.predicted_error == pytest.approx(brute_force(coeffs, budget), rel=1e-9, abs=1e-12)
            assert _measure(coeffs, plan) == pytest.approx(plan.predicted_error, rel=1e-6, abs=1e-9)


def test_kv_split_is_the_best_of_every_split():
    """split_budget = exhaustive search over every division of the shared budget between two curves."""
    rnd = random.Random(6)
    for trial in range(15):
        ka, kb = rnd.randint(1, 6), rnd.randint(1, 6)
        a = torch.randn(8, ka, generator=torch.Generator().manual_seed(200 + trial)) * rnd.uniform(0.1, 5)
        b = torch.randn(8, kb, generator=torch.Generator().manual_seed(300 + trial)) * rnd.uniform(0.1, 5)
        total = rnd.randint(0, 30 * (ka + kb)) // 2 * 2
        wa, wb = rnd.uniform(0.2, 3), rnd.uniform(0.2, 3)
        ca, cb = error_curve(a, total, sizes=SIZES, types=TYPES), error_curve(b, total, sizes=SIZES, types=TYPES)
        ba, bb = split_budget(ca, cb, total, wa, wb)
        assert ba + bb <= total
        got = wa * ca.plan(ba).predicted_error + wb * cb.plan(bb).predicted_error
        want = min(wa * brute_force(a, x) + wb * brute_force(b, total - x) for x in range(0, total + 1))
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_coarsened_budget_axis_stays_within_budget():
    coeffs = torch.randn(64, 512, generator=torch.Generator().manual_seed(4)) * torch.logspace(1, -2, 512)
    budget = budget_for_ratio(512, 4)
    plan = allocate(coeffs, budget, max_columns=64)
    assert not plan.exact and plan.meta["unit_bits"] > 2
    assert plan.bits_per_token <= budget
    exact = allocate(coeffs, budget)
    assert exact.predicted_error <= plan.predicted_error * (1 + 1e-12)


def test_plan_serialisation_round_trip_and_validation():
    coeffs = torch.randn(32, 100) * torch.logspace(1, -2, 100)
    plan = allocate(coeffs, 600)
    again = Plan.from_dict(plan.to_dict(), 100)
    assert again.segments == plan.segments and again.predicted_error == plan.predicted_error
    bad = plan.to_dict()
    bad["segments"] = [[16, INT4, 10**9]]
    with pytest.raises(CalibrationError):
        Plan.from_dict(bad, 100)
    bad["segments"] = [[1, 1, 1], [16, 2, 1]]  # a 16-group starting at 1 is unaligned
    with pytest.raises(CalibrationError):
        Plan.from_dict(bad, 100)


def test_prediction_equals_codec_encode_decode_on_the_dp_rows():
    """The DP's predicted error equals what Codec.encode/decode really does to the rows it measured."""
    from kvtc import KVLayout, KVSlice
    from kvtc.calibration import Recipe, fit_calibration
    from kvtc.codec import Codec

    layout = KVLayout(layers=(0, 1, 2, 3), num_kv_heads=2, head_dim=32, dtype="float32")
    p = layout.num_features
    g = torch.Generator().manual_seed(11)
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
    x = (torch.randn(800, p, generator=g) * torch.logspace(1, -3, p)) @ q.T + 2.0
    # dp_rows >= the number of rows: the DP measures exactly these rows
    cal = fit_calibration(layout, [(x, x)], Recipe(ratios=(4, 16, 32), dp_rows=800))
    kv = KVSlice(layout, x.reshape(1, 800, 4, 2, 32), x.reshape(1, 800, 4, 2, 32), torch.arange(800)[None])
    energy = float((x.double() - cal.pcas["keys"][0].mean.double()).square().sum())
    for r in (4, 16, 32):
        out = Codec(cal, ratio=r, sinks=0, window=0).decode(Codec(cal, ratio=r, sinks=0, window=0).encode(kv))
        measured = float((out.keys.reshape(800, p).double() - x.double()).square().sum())
        predicted = cal.stats["predicted_relative_error"][str(r)]["keys"][0] * energy
        assert measured == pytest.approx(predicted, rel=0.01), r


def test_joint_kv_split_gives_the_flatter_spectrum_more_of_the_shared_budget():
    """Values with a flatter spectrum than keys get more of the shared 2·16p/CR bits (split where
    ``err_K/E_K + value_weight·err_V/E_V`` is least), recorded per ratio."""
    from kvtc import KVLayout
    from kvtc.calibration import Recipe, fit_calibration

    layout = KVLayout(layers=(0, 1), num_kv_heads=2, head_dim=32, dtype="float32")
    p = layout.num_features
    g = torch.Generator().manual_seed(12)
    keys = torch.randn(1200, p, generator=g) * torch.logspace(1, -3, p)
    values = torch.randn(1200, p, generator=g) * torch.logspace(0.5, -0.5, p)
    cal = fit_calibration(layout, [(keys, values)], Recipe(ratios=(8, 16), dp_rows=600, value_weight=2.0))
    split = cal.stats["kv_split"]
    assert split["mode"] == "joint" and split["errors"] == "relative" and split["value_weight"] == 2.0
    for r in (8, 16):
        plans = cal.plans_for(r)
        assert plans["values"][0].bits_per_token > plans["keys"][0].bits_per_token
        assert split["value_share"][str(r)][0] > 0.5
    with pytest.raises(TypeError, match="kv_split"):
        Recipe(ratios=(8,), kv_split="equal")


def test_coded_bits_are_each_components_symbol_entropy_plus_its_params():
    from kvtc.quant import INT2S, INT4S, PARAM_BITS, coded_bits

    n = 64
    col0 = torch.full((n,), 3.0)  # one symbol: 0 bits
    col1 = torch.tensor([1.0, -1.0] * (n // 2))  # two symbols, equally often: 1 bit (+ Miller-Madow 1/(2n ln 2))
    col2 = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x = torch.stack([col0, col1, col2, col2], 1).reshape(n, 1, 4)
    bits = coded_bits(x, INT4S)
    sym, _, _ = quantize(x, INT4S)
    want = PARAM_BITS
    for c in range(4):
        _, counts = torch.unique(sym[:, 0, c], return_counts=True)
        prob = counts.double() / n
        want += min(float(-(prob * prob.log2()).sum()) + (len(counts) - 1) / (2 * n * math.log(2)), 4.0)
    assert float(bits[0]) == pytest.approx(want, rel=1e-9)
    # each column's share: a constant's symbols cost nothing, a sign pattern one bit
    one = coded_bits(torch.stack([col0, col1], 1).reshape(n, 2, 1), INT2S)
    assert float(one[0]) == pytest.approx(PARAM_BITS, abs=1e-9)
    assert float(one[1]) == pytest.approx(PARAM_BITS + 1 + 1 / (2 * n * math.log(2)), rel=1e-9)
    # never above the packed width: uniform symbols of many levels on few rows
    wide = coded_bits(torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(1)), FP8)
    assert bool((wide <= group_bits(16, FP8) + 1e-9).all())


def test_a_calibration_stores_its_target():
    """Each plan's entropy-coded sections are fitted to the budget (STORED_HEADROOM, 5%, kept) on calibration rows
    the DP did not see: a blob of held-out rows meets its target, and not by far more."""
    from kvtc import KVLayout, KVSlice
    from kvtc.calibration import Recipe, fit_calibration
    from kvtc.codec import Codec

    layout = KVLayout(layers=(0, 1, 2, 3), num_kv_heads=2, head_dim=32, dtype="float32")
    p, n = layout.num_features, 2048
    g = torch.Generator().manual_seed(12)
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
    lap = torch.distributions.Laplace(0.0, 1.0).sample((2 * n, p))
    x = (lap * torch.logspace(1, -3, p)) @ q.T + 2.0
    fit, held = x[:n], x[n:]
    kv = KVSlice(layout, held.reshape(1, n, 4, 2, 32), held.reshape(1, n, 4, 2, 32), torch.arange(n)[None])
    cal = fit_calibration(layout, [(fit, fit)], Recipe(ratios=(8, 16)))
    for r in (8, 16):
        blob = Codec(cal, ratio=r, sinks=0, window=0).encode(kv)
        stored = 2 * n * p * 2 / len(blob)  # against bf16 keys and values
        assert r <= stored < 1.1 * r, (r, stored)
