"""Fixed-step quantization types (int2f / int4f / int8f): quantizer semantics, the DP's rung candidates against an
exhaustive search, plan validation and the calibration file version that holds them."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from kvtc import KVLayout
from kvtc.calibration import Calibration, Recipe, fit_calibration
from kvtc.calibration.dp import FIXED_RUNGS, Plan, allocate, candidate_errors, error_curve, fixed_ladder, real_type
from kvtc.calibration.meta import FORMAT_VERSION
from kvtc.errors import CalibrationError
from kvtc.quant import (
    FIXED_HALF,
    INT2,
    INT2F,
    INT4F,
    INT4S,
    INT8F,
    coded_bits,
    dequantize,
    group_bits,
    param_rows,
    quantize,
    squared_error,
)
from synthetic import LowRankSource

FIXED = (INT2F, INT4F, INT8F)


@pytest.mark.parametrize("qtype", FIXED)
def test_fixed_step_symbols_are_rounded_multiples_of_the_step_clamped_to_the_width(qtype):
    g = torch.Generator().manual_seed(qtype)
    x = torch.randn(500, 3, 4, generator=g) * torch.tensor([0.1, 1.0, 30.0])[None, :, None]
    steps = torch.tensor([0.02, 0.37, 1.5], dtype=torch.float32)
    sym, _, _ = quantize(x, qtype, steps)
    half = FIXED_HALF[qtype]
    assert param_rows(qtype) == 0 and sym.dtype == torch.uint8 and int(sym.max()) <= 2 * half
    # independent arithmetic: float64 division of float32 values, half-to-even rounding, clamping
    want = (x.double() / steps.double()[None, :, None]).round().clamp(-half, half) + half
    assert torch.equal(sym.long(), want.long())
    y = dequantize(sym, None, None, qtype, steps)
    inside = (x.abs() <= half * steps[None, :, None]).expand_as(x)
    assert bool(((y - x).abs()[inside] <= steps[None, :, None].expand_as(x)[inside] / 2 * (1 + 1e-6)).all())
    # beyond the range the value saturates at ±h·step
    assert torch.allclose(y[~inside].abs(), (half * steps[None, :, None]).expand_as(x)[~inside])
    with pytest.raises(ValueError):
        quantize(x, qtype, torch.tensor([0.1, 0.0, 1.0]))
    with pytest.raises(ValueError):
        dequantize(sym, None, None, qtype)


def test_coded_cost_of_a_fixed_step_type_is_floored_at_one_bit_a_byte():
    x = torch.zeros(256, 2, 1)  # every symbol the same: zero entropy, but a byte-wise coder spends a bit a byte
    for t in FIXED:
        bits = {INT2F: 2, INT4F: 4, INT8F: 8}[t]
        assert coded_bits(x, t, 1.0).tolist() == [bits / 8] * 2


def _brute(coeffs: torch.Tensor, types, budget: float, coded: bool) -> float:
    """Least error over every choice, per component, of dropping it or one (type, rung) of size 1, each costing its
    (coded or packed) bits rounded up to whole bits."""
    costs: dict = {}
    drop, errs = candidate_errors(coeffs, (1,), types, clips={}, costs=costs if coded else None)
    k = coeffs.shape[1]
    options = []
    for j in range(k):
        opts = [(0, float(drop[j]))]
        for key, e in errs.items():
            if coded:
                cost = math.ceil(float(costs[key][j]) - 1e-9)
            else:  # packed bits, in the DP's 2-bit units
                cost = 2 * math.ceil(group_bits(1, real_type(key[1])) / 2)
            opts.append((cost, float(e[j])))
        options.append(opts)
    best = math.inf
    for combo in itertools.product(*options):
        if sum(c for c, _ in combo) <= budget:
            best = min(best, sum(e for _, e in combo))
    return best


@pytest.mark.parametrize("rate", ["coded", "nominal"])
def test_dp_with_fixed_step_rungs_matches_exhaustive_search(rate):
    g = torch.Generator().manual_seed(7)
    for trial in range(6):
        k = 2 if trial % 2 else 3
        coeffs = torch.randn(64, k, generator=g) * torch.rand(k, generator=g) * 4
        types = (INT2F, INT4F) if trial < 3 else (INT2, INT8F)
        budget = float(torch.randint(1, 12 * k, (1,), generator=g))
        plan = allocate(coeffs, budget, sizes=(1,), types=types, rate=rate)
        want = _brute(coeffs, types, budget, rate == "coded")
        assert plan.predicted_error == pytest.approx(want, rel=1e-12, abs=1e-12), (trial, budget)
        # the plan's types and steps reproduce that error
        steps = iter(plan.kept_clips())
        got = 0.0
        for start, size, t in plan.groups():
            x = coeffs[:, start : start + size].unsqueeze(1)
            got += float(x.double().square().sum()) if t == 0 else float(squared_error(x, t, next(steps)).sum())
        got += float(coeffs[:, plan.num_components :].double().square().sum())
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
        ladder = fixed_ladder(coeffs).tolist()
        for (_, _, t), step in zip([gr for gr in plan.groups() if gr[2]], plan.kept_clips()):
            if t in FIXED:
                assert step in ladder


def test_fixed_step_rungs_lower_the_error_at_the_same_coded_bits():
    # components of falling variance: without per-token range parameters the same coded bits buy less error
    g = torch.Generator().manual_seed(3)
    coeffs = torch.randn(1024, 128, generator=g) * torch.logspace(0, -2, 128)
    base = error_curve(coeffs, 256, rate="coded", types=(INT2, INT4S))
    with_fixed = error_curve(coeffs, 256, rate="coded", types=(INT2, INT4S, *FIXED))
    for bits in (64, 128, 256):
        assert with_fixed.error(bits) < 0.9 * base.error(bits)
        plan = with_fixed.plan(bits)
        assert plan.meta["coded_bits"] <= bits
        assert any(t in FIXED for _, t, _ in plan.segments)
    assert len(fixed_ladder(coeffs)) == FIXED_RUNGS


def test_plans_with_bad_steps_are_refused():
    good = Plan(((16, INT4S, 1), (1, INT4F, 2)), clips=(1.0, 0.25, 3.5))
    assert Plan.from_dict(good.to_dict(), 64) == good
    for clips in ((1.0, 0.0, 3.5), (1.0, -1.0, 3.5), (1.0, float("inf"), 1.0), (1.0, 0.25), (2.0, 0.25, 3.5)):
        bad = dataclasses.replace(good, clips=clips).to_dict()
        with pytest.raises(CalibrationError, match="clips|steps"):
            Plan.from_dict(bad, 64)


def test_a_calibration_with_fixed_step_plans_round_trips():
    layout = KVLayout(layers=(0, 1), num_kv_heads=2, head_dim=16)
    p = layout.num_features
    k, v = LowRankSource(p, decay=1e-2, seed=0).rows(2048), LowRankSource(p, decay=1e-2, seed=1).rows(2048)
    cal = fit_calibration(layout, [(k, v)], Recipe(ratios=(8, 16), dp_rows=512, types=(INT2, INT4S, *FIXED)))
    assert cal.types & set(FIXED) and cal.version == FORMAT_VERSION
    back = Calibration.from_bytes(cal.to_bytes())
    assert back.hash == cal.hash and back.plans == cal.plans
