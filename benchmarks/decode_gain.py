"""Headroom of decoding fixed-step groups away from their bins' midpoints, at the same symbols and bits.

The DP of ``kvtc calibrate`` (recipe r10) on the sensitivity-weighted coefficient rows of one model's PCA groups
of at most ``MAXK`` components (Gemma-3-270M: its 3 full-attention layers), each fixed-step rung measured three
ways: decoded at its midpoints ``q · step`` (r10), at per-level centroids (the conditional mean of each symbol
magnitude's values, the best decoder of those symbols for squared error) and at one least-squares gain per component
``a · q · step``. Centroids and gains are fitted on one half of the 4,096 DP rows and measured on the other (both
ways), so they gain nothing from seeing their own rows; costs are the coded rate's, the same for the three (the
symbols do not change). Prints the DP's least weighted error over the rows' energy at 16x, 32x and 64x (budgets with
the stored rate's 5% headroom). The end-to-end test of the gains (in the codec at commit 009bb4e, reverted: lower
error, higher next-token KL) is in BENCHMARKS.md "Decode gains for fixed-step groups (Gemma-3-270M)".
Usage: ``python benchmarks/decode_gain.py [gemma3|smollm2] [MAXK]`` (about 10 minutes on 2 cores for Gemma-3's
full-attention group).
"""

import sys

import numpy as np
import torch

from kvtc import assets
from kvtc.calibration import Recipe, fit_calibration, sensitivity_scales
from kvtc.calibration import fit as fit_mod
from kvtc.calibration.dp import (
    _VIRTUAL,
    DEFAULT_MAX_COLUMNS,
    FIXED_RUNGS,
    _solve,
    budget_for_ratio,
    candidate_errors,
    fixed_ladder,
)
from kvtc.calibration.fit import DEFAULT_SENSITIVITY_FLOOR
from kvtc.integrations.hf import describe_model
from kvtc.integrations.hf_calibrate import collect_rows, measure_sensitivity
from kvtc.quant import FIXED_HALF, INT2

MODEL = sys.argv[1] if len(sys.argv) > 1 else "gemma3"
MAXK = int(sys.argv[2]) if len(sys.argv) > 2 else 800
torch.manual_seed(0)
model, tok = assets.load_model(MODEL)
layout, rope = describe_model(model)
texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
fisher = measure_sensitivity(model, tok, texts, progress=False)
rows = list(collect_rows(model, tok, texts, 30_000, progress=False))
scales = sensitivity_scales(fisher, "feature", DEFAULT_SENSITIVITY_FLOOR, layout.head_dim, normalize="kind")
seen = []
orig = fit_mod.error_curve


def hook(coeffs, mb, sizes, types, **kw):
    if coeffs.shape[1] <= MAXK:
        seen.append(coeffs.detach().clone())
        return orig(coeffs, mb, sizes, types, **kw)
    return orig(coeffs, mb, (1,), (INT2,), **kw)


fit_mod.error_curve = hook
cal = fit_calibration(
    layout, rows, Recipe(ratios=(16, 32, 64), dp_rows=4096), feature_scale=scales, rope=rope.to_dict()
)
fit_mod.error_curve = orig
del rows, model


def centroid_err(x, t, step, min_count=8):
    h = FIXED_HALF[t]
    n, k = x.shape
    half = n // 2
    tot = torch.zeros(k, dtype=torch.float64)
    parts = [(slice(0, half), slice(half, n)), (slice(half, n), slice(0, half))]
    for fit_s, app_s in parts:
        xa, xb = x[fit_s], x[app_s]
        qa = (xa / step).round().clamp(-h, h)
        ma = qa.abs().long()
        r = (xa.abs() / step).double()
        idx = ma + (h + 1) * torch.arange(k).unsqueeze(0)
        sums = torch.zeros(k * (h + 1), dtype=torch.float64).scatter_add_(0, idx.flatten(), r.flatten())
        cnt = torch.zeros(k * (h + 1), dtype=torch.float64).scatter_add_(0, idx.flatten(), torch.ones_like(r).flatten())
        mid = torch.arange(h + 1, dtype=torch.float64).repeat(k)
        cen = torch.where(cnt >= min_count, sums / cnt.clamp(min=1), mid)
        cen = cen.view(k, h + 1)
        cen[:, 0] = 0
        qb = (xb / step).round().clamp(-h, h)
        mb_ = qb.abs().long()
        rec = torch.gather(cen, 1, mb_.T).T * qb.sign().double() * step
        tot += (xb.double() - rec).square().sum(0)
    return tot


def scale_err(x, t, step):
    h = FIXED_HALF[t]
    n, k = x.shape
    half = n // 2
    tot = torch.zeros(k, dtype=torch.float64)
    for fit_s, app_s in [(slice(0, half), slice(half, n)), (slice(half, n), slice(0, half))]:
        xa, xb = x[fit_s].double(), x[app_s].double()
        qa = (xa / step).round().clamp(-h, h)
        den = qa.square().sum(0)
        a = torch.where(den > 0, (xa * qa).sum(0) / den.clamp(min=1e-30) / step, torch.ones(k, dtype=torch.float64))
        qb = (xb / step).round().clamp(-h, h)
        tot += (xb - qb * a * step).square().sum(0)
    return tot


out = []
for ci, coeffs in enumerate(seen):
    kind = ("keys", "values")[ci % 2]
    coeffs = coeffs.float()
    n, k = coeffs.shape
    energy = float(coeffs.double().square().sum())
    clips, costs = {}, {}
    drop, errs = candidate_errors(coeffs, clips=clips, costs=costs)
    errs2 = dict(errs)
    errs3 = dict(errs)
    ladder = fixed_ladder(coeffs).tolist()
    for key in errs:
        if key[1] >= _VIRTUAL:
            t, r = divmod(key[1] - _VIRTUAL, FIXED_RUNGS)
            errs2[key] = centroid_err(coeffs, t, ladder[r])
            errs3[key] = scale_err(coeffs, t, ladder[r])
    # in-sample midpoint errors of fixed rungs are exact (no fitting), so the comparison is fair
    for ratio in (16, 32, 64):
        b = budget_for_ratio(k, ratio) * 0.95
        l1, *_ = _solve(drop, errs, b, DEFAULT_MAX_COLUMNS, costs)
        l2, *_ = _solve(drop, errs2, b, DEFAULT_MAX_COLUMNS, costs)
        l3, *_ = _solve(drop, errs3, b, DEFAULT_MAX_COLUMNS, costs)
        e1, e2, e3 = (np.minimum.accumulate(last)[-1] / energy for last in (l1, l2, l3))
        print(
            f"{MODEL} k={k} {kind} {ratio}x: midpoint {e1:.4f} centroid {e2:.4f} ({(e2 / e1 - 1) * 100:+.1f}%) gain {e3:.4f} ({(e3 / e1 - 1) * 100:+.1f}%)",
            flush=True,
        )
