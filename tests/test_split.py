"""The host side of the GPU restore's two-part keys (CPU): which rows of each stream the first components'
groups take, and a reconstruction in two products equal to one."""

from __future__ import annotations

import pytest
import torch

from kvtc import KVLayout
from kvtc.calibration import Recipe, fit_calibration
from kvtc.calibration.dp import Plan
from kvtc.codec.quantizer import PlanLayout, plan_layouts
from kvtc.codec.transform import PCATransform
from kvtc.quant import DROP, param_rows
from synthetic import LowRankSource


@pytest.fixture(scope="module")
def cal():
    layout = KVLayout(layers=(0, 1, 3), num_kv_heads=2, head_dim=64, dtype="bfloat16")
    p = layout.num_features
    ks = LowRankSource(p, decay=1e-3, noise=1e-3, seed=3)
    vs = LowRankSource(p, decay=1e-2, noise=1e-3, seed=4)
    return fit_calibration(layout, [(ks.rows(2048), vs.rows(2048)) for _ in range(2)], Recipe(ratios=(4, 16)))


def _mixed_plan() -> Plan:
    # groups of several sizes and types, dropped ones between kept ones
    return Plan(((4, 2, 3), (1, 4, 5), (8, DROP, 1), (16, 1, 2), (2, 3, 4), (8, DROP, 2), (3, 2, 1)))


@pytest.mark.parametrize("first", [0, 1, 4, 12, 13, 17, 20, 33, 40, 57, 64, 80, 1000])
def test_split_rows_are_the_first_groups_rows(first):
    pl = PlanLayout.build(_mixed_plan())
    rows, counts = pl.split(first)
    kept = [(s, n, t) for s, n, t in pl.plan.groups() if t != DROP]
    early = [(s, n, t) for s, n, t in kept if s < first]
    assert rows[None] == sum(param_rows(t) for _, _, t in early)
    for t in pl.plane_sizes:
        assert rows[t] == sum(n for _, n, tt in early if tt == t)
    for b, c in zip(pl.buckets, counts):
        starts = b.columns[:, 0]
        assert bool((starts[:c] < first).all()) and bool((starts[c:] >= first).all())  # a prefix of the bucket
        # the groups' plane rows and params rows are below the first part's row counts (a prefix of each stream)
        if c:
            assert int(b.plane_rows.view(-1, b.size)[:c].max()) < rows[b.qtype]
            assert int(b.param_rows[:c].max()) < rows[None]
        if c < len(starts):
            assert int(b.plane_rows.view(-1, b.size)[c:].min()) >= rows[b.qtype]
            assert int(b.param_rows[c:].min()) >= rows[None]


def test_plan_layouts_are_built_once_per_ratio(cal):
    a = plan_layouts(cal, "16")
    assert a is plan_layouts(cal, "16")
    assert a["keys"][0].components == PlanLayout.build(cal.plans["16"]["keys"][0]).components
    assert plan_layouts(cal, "4") is not a


def test_reconstruction_in_two_products_equals_one(cal):
    tr = PCATransform(cal, torch.device("cpu"), "fp32", fused=False)
    k = PlanLayout.build(cal.plans["16"]["keys"][0]).components
    assert k > 16
    g = torch.Generator().manual_seed(0)
    coeffs = torch.randn(37, k, generator=g)
    one = tr.reconstruct("keys", 0, coeffs, k)
    for cut, cols in ((8, None), (k // 2 // 8 * 8, (64, 192))):
        outs = [torch.empty(20, 384 if cols is None else 128), torch.empty(17, 384 if cols is None else 128)]
        tr.reconstruct("keys", 0, coeffs[:, :cut], cut, outs, columns=cols)
        tr.reconstruct_add("keys", 0, coeffs, cut, k, outs, columns=cols)
        ref = one if cols is None else one[:, cols[0] : cols[1]]
        torch.testing.assert_close(torch.cat(outs), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    fp8 = PCATransform(cal, torch.device("cpu"), "fp8", fused=True)
    with pytest.raises(ValueError, match="fp8"):
        fp8.reconstruct_add("keys", 0, coeffs, 8, k, [torch.empty(37, 384)])
