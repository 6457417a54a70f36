"""Headroom of fixed-step groups: PCA coefficients quantized with one step per group fixed at calibration time
(no per-token range parameters), beside today's per-token min/max and scale-only groups.

Every kept group of today's types carries a 16-bit shift and scale, or a scale, *per token*; on Gemma-3-270M's
full-attention keys those take 20-29% of the bits at 16-32x (BENCHMARKS.md "Full vs diagonal Fisher weighting").
A group quantized as ``q = clamp(round(x / step), -h, h)`` with ``step`` from the calibration stores its symbols
only, and the entropy coder turns the step's precision into bits: entropy-coded uniform scalar quantization, which at
high rate is within a quarter bit of the rate-distortion bound for each component.

Method: the sensitivity-weighted coefficient rows the DP of ``kvtc calibrate`` sees (``--tokens`` calibration rows of
the pre-2000 speeches, ``--dp-rows`` of them sampled), the DP run twice on the same rows: with today's candidates
(every default type and group size), and with those plus fixed-step groups of 1, 16 or 64 components, 2-, 4- or
8-bit symbols (``h`` = 1, 7, 127) and one of 20 steps (``σ_max · 2^(-i/2)``). Every candidate's cost is its
symbols' order-0 code length measured *across halves* of the rows (each half coded with the other half's symbol frequencies, add-½ smoothed over the whole alphabet) plus
its per-token range parameters at 16 bits, so that neither side gains from an in-sample entropy estimate (the
coded rate's own estimate is in-sample); a fixed-step symbol of ``b`` bits costs at least ``b/8`` bits, the floor of
a byte-wise Huffman coder. kvtc's coder has one Huffman table per type's stream, not one per component: the
per-component code lengths here are what a coder with per-component frequencies (rANS) would reach, so each plan is
also stored with kvtc's own coders (one stream per type and one of range parameters), and the last comparison
holds those stored bits equal. Errors are the DP's: summed squared error in the weighted PCA space, over the energy
of the rows. Budgets are the coded rate's (3% headroom), each kind at the target on its own.

This is an upper-bound study of the plan space, made before the codec had fixed-step groups: it says how much lower
the measured error could go at the same stored bits (the codec's types ``int2f`` / ``int4f`` / ``int8f``, measured
end to end by ``benchmarks/fixed_types.py``, came of it). Writes benchmarks/results/fixed_step_<model>[_<groups>].json
and the section of that name in BENCHMARKS.md. Usage:
``python benchmarks/fixed_step.py [--model gemma3|smollm2] [--groups all|smallest|largest]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

import _report
from kvtc import assets
from kvtc.calibration import Recipe, fit_calibration, sensitivity_scales
from kvtc.calibration import dp as dp_mod
from kvtc.calibration import fit as fit_mod
from kvtc.calibration.dp import DEFAULT_SIZES, DEFAULT_TYPES, budget_for_ratio, candidate_errors
from kvtc.calibration.fit import DEFAULT_SENSITIVITY_FLOOR
from kvtc.calibration.recipe import CODED_HEADROOM
from kvtc.codec.entropy import DEFAULT_BACKEND, get_backend
from kvtc.codec.packing import pack
from kvtc.integrations.hf import describe_model
from kvtc.integrations.hf_calibrate import collect_rows, measure_sensitivity
from kvtc.quant import DROP, FP8_TYPES, PARAM_BITS, TYPE_BITS, TYPE_NAMES, param_rows, quantize

#: half-widths of a fixed-step group's symbols: 2-bit (-1..1), 4-bit (-7..7) and 8-bit (-127..127) planes
HALF_WIDTHS = (1, 7, 127)
#: pseudo type codes of the fixed-step candidates (step index i = code - FIXED)
FIXED = 100
STEPS = 20
FIXED_SIZES = (1, 16, 64)
#: the coder whose stored bits the matched comparison holds equal (the CPU codec's default backend)
CODER = DEFAULT_BACKEND


def cross_bits(sym: torch.Tensor, levels: int) -> torch.Tensor:
    """Order-0 code length per token of each component ``[m * g]`` of ``sym`` [n, m, g] (long, 0..levels-1), each
    half of the rows coded with the other half's add-½ smoothed frequencies; summed per group -> ``[m]``."""
    n, m, g = sym.shape
    flat = sym.reshape(n, m * g)
    comp = torch.arange(m * g).unsqueeze(0) * levels
    total = torch.zeros(m * g, dtype=torch.float64)
    halves = (flat[0::2], flat[1::2])
    for a, b in (halves, halves[::-1]):
        cnt = torch.bincount((a + comp).reshape(-1), minlength=m * g * levels).reshape(m * g, levels).double()
        logp = torch.log2((cnt + 0.5) / (a.shape[0] + 0.5 * levels))
        total -= logp.gather(1, b.T).sum(1)
    return (total / n).reshape(m, g).sum(1)


def today_candidates(coeffs: torch.Tensor) -> tuple[dict, dict, dict]:
    """Errors, cross-validated costs and clips of today's candidates (the DP's own errors and best clips)."""
    clips: dict = {}
    _, errs = candidate_errors(coeffs, DEFAULT_SIZES, DEFAULT_TYPES, clips)
    n, k = coeffs.shape
    costs = {}
    for g, t in errs:
        m = k // g
        sym, _, _ = quantize(coeffs[:, : m * g].reshape(n, m, g), t, clips.get((g, t), 1.0))
        levels = 256 if t in FP8_TYPES else 1 << TYPE_BITS[t]
        costs[(g, t)] = cross_bits(sym.long(), levels) + PARAM_BITS * param_rows(t)
    return errs, costs, clips


def fixed_symbols(x: torch.Tensor, top: float, code: int) -> tuple[torch.Tensor, float, int, int]:
    """Fixed-step candidate ``code`` applied to ``x``: symbols ``q`` in ``-h..h``, the step, ``h`` and the bits of a
    symbol. ``top``: the largest component standard deviation of the rows (the step ladder's start)."""
    w, i = divmod(code - FIXED, STEPS)
    half = HALF_WIDTHS[w]
    step = top * 2 ** (-i / 2)
    return torch.clamp(torch.round(x / step), -half, half), step, half, math.ceil(math.log2(2 * half + 1))


def fixed_candidates(coeffs: torch.Tensor) -> tuple[dict, dict]:
    """Errors and costs of fixed-step groups: every (size, width, step); a width-``b`` symbol costs at least ``b/8``
    bits (a byte-wise Huffman coder codes ``8/b`` packed symbols in no less than one bit)."""
    errs, costs = {}, {}
    n, k = coeffs.shape
    top = float(coeffs.std(0).max())
    for g in FIXED_SIZES:
        m = k // g
        x = coeffs[:, : m * g].reshape(n, m, g)
        for code in range(FIXED, FIXED + len(HALF_WIDTHS) * STEPS):
            q, step, half, bits = fixed_symbols(x, top, code)
            errs[(g, code)] = (x - q * step).double().square().sum(dim=(0, 2))
            costs[(g, code)] = cross_bits((q + half).long(), 2 * half + 1).clamp(min=g * bits / 8)
    return errs, costs


def solve(coeffs: torch.Tensor, errs: dict, costs: dict, budget: float) -> tuple[np.ndarray, Any]:
    """The DP's least error within every budget unit, and a function giving the plan ``[(size, code)]`` at one."""
    drop = coeffs.double().square().sum(0)
    last, choice, cands, _, units = dp_mod._solve(drop, errs, budget, 1 << 16, costs)
    best = np.minimum.accumulate(last)

    def plan(u: int) -> list[tuple[int, int]]:
        b = int(np.flatnonzero(last[: u + 1] == best[u])[0])
        return dp_mod._backtrack(choice, cands, b, units)

    return best, plan


def stored_bits(coeffs: torch.Tensor, groups: list[tuple[int, int]], clips: dict) -> dict[str, float]:
    """Bits per row that kvtc's coders store for a plan: one stream per quantization type (and per fixed-step
    symbol width) with every kept group's planes in component order and one stream of the per-token range
    parameters, each coded as a blob codes it (zstd, the CPU default, and huff4k)."""
    n = coeffs.shape[0]
    top = float(coeffs.std(0).max())
    planes: dict[tuple[str, int], list[torch.Tensor]] = {}
    params: list[torch.Tensor] = []
    start = 0
    for g, code in groups:
        x = coeffs[:, start : start + g].reshape(n, 1, g)
        if code >= FIXED:
            q, _, half, bits = fixed_symbols(x, top, code)
            planes.setdefault(("fixed", bits), []).append((q + half).to(torch.uint8).reshape(n, g).T)
        elif code != DROP:
            clip = clips.get((g, code), 1.0)
            clip = clip[start // g : start // g + 1] if isinstance(clip, torch.Tensor) else clip
            sym, shift, scale = quantize(x, code, clip)
            planes.setdefault((TYPE_NAMES[code], TYPE_BITS[code]), []).append(sym.reshape(n, g).T)
            if param_rows(code) == 2:
                params.append(shift.reshape(1, n))
            params.append(scale.reshape(1, n))
        start += g
    streams = [pack(torch.cat(ps), bits).numpy().tobytes() for (_, bits), ps in planes.items()]
    if params:
        streams.append(torch.cat(params).numpy().tobytes())
    out = {"packed": 8.0 * sum(len(b) for b in streams) / n}
    for name in ("zstd", "huff4k"):
        coder = get_backend(name)
        out[name] = 8.0 * sum(min(len(coder.compress(b)), len(b)) for b in streams) / n
    return out


def matched(
    best: np.ndarray, plan: Any, coeffs: torch.Tensor, clips: dict, bits: float, coder: str
) -> tuple[float, int]:
    """The least error of a curve whose plan stores at most ``bits`` per row with ``coder`` (bisection over the
    budget: stored bits grow with it), and that plan's budget unit."""
    lo, hi = 0, best.size - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if stored_bits(coeffs, plan(mid), clips)[coder] <= bits:
            lo = mid
        else:
            hi = mid - 1
    return float(best[lo]), lo


@contextmanager
def captured_rows():
    """The coefficient rows each (PCA group, kind) DP of a fit sees, in call order."""
    seen: list[torch.Tensor] = []
    orig = fit_mod.error_curve

    def hook(coeffs, *a, **kw):
        seen.append(coeffs.detach().clone())
        return orig(coeffs, *a, **kw)

    fit_mod.error_curve = hook
    try:
        yield seen
    finally:
        fit_mod.error_curve = orig


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="fixed_step")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--tokens", type=int, default=30_000)
    ap.add_argument("--dp-rows", type=int, default=4096)
    ap.add_argument("--ratios", type=float, nargs="+", default=[16, 32, 64])
    ap.add_argument(
        "--groups", choices=("all", "smallest", "largest"), default="all",
        help="PCA groups to study: all, or the one of fewest / most features (Gemma-3: its 3 full-attention layers / "
        "its 15 sliding-window layers, whose DP over 3,840 components takes far longer)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = assets.load_model(args.model)
    layout, rope = describe_model(model)
    texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
    fisher = measure_sensitivity(model, tok, texts, progress=False)
    rows = list(collect_rows(model, tok, texts, args.tokens, progress=False))
    scales = sensitivity_scales(fisher, "feature", DEFAULT_SENSITIVITY_FLOOR, layout.head_dim, normalize="kind")
    with captured_rows() as seen:
        cal = fit_calibration(
            layout, rows, Recipe(ratios=tuple(args.ratios), dp_rows=args.dp_rows), feature_scale=scales,
            rope=rope.to_dict(),
        )  # fmt: skip
    del rows, model
    orig_bits = dp_mod.group_bits
    dp_mod.group_bits = lambda g, t: 0 if t >= FIXED else orig_bits(g, t)  # fixed-step costs come from `costs`
    out_rows = []
    sizes = [c.numel() for c in cal.columns]
    chosen = {"all": range(len(sizes)), "smallest": [sizes.index(min(sizes))], "largest": [sizes.index(max(sizes))]}[
        args.groups
    ]
    try:
        for i, coeffs in enumerate(seen):
            g, kind = divmod(i, 2)
            if g not in chosen:
                continue
            kind_name = ("keys", "values")[kind]
            p = cal.columns[g].numel()
            layers = p // (len(layout.heads) * layout.head_dim)
            budgets = [budget_for_ratio(p, r) * (1 - CODED_HEADROOM) for r in args.ratios]
            energy = float(coeffs.double().square().sum())
            e0, c0, clips = today_candidates(coeffs)
            e1, c1 = fixed_candidates(coeffs)
            today, today_plan = solve(coeffs, e0, c0, max(budgets))
            both, both_plan = solve(coeffs, {**e0, **e1}, {**c0, **c1}, max(budgets))
            fixed, _ = solve(coeffs, e1, c1, max(budgets))
            for r, b in zip(args.ratios, budgets):
                u = int(min(b, today.size - 1))
                st0 = stored_bits(coeffs, today_plan(u), clips)
                st1 = stored_bits(coeffs, both_plan(u), clips)
                # the plan with fixed-step groups that stores no more than today's, by the CPU default coder
                e_match, u_match = matched(both, both_plan, coeffs, clips, st0[CODER], CODER)
                row = {
                    "group": g, "layers": layers, "features": p, "kind": kind_name, "target": r,
                    "budget_bits": round(b, 1), "today": today[u] / energy, "fixed_only": fixed[u] / energy,
                    "with_fixed": both[u] / energy, "today_stored": st0, "with_fixed_stored": st1,
                    "matched": e_match / energy, "matched_budget_bits": u_match,
                    "matched_stored": stored_bits(coeffs, both_plan(u_match), clips),
                }  # fmt: skip
                out_rows.append(row)
                print(
                    f"group {g} ({layers} layers) {kind_name} {r:g}x (budget {b:.0f} bits): today {row['today']:.4f} "
                    f"stores {st0}, fixed-step only {row['fixed_only']:.4f}, both {row['with_fixed']:.4f} stores {st1}; "
                    f"at today's stored bits {row['matched']:.4f}",
                    flush=True,
                )
    finally:
        dp_mod.group_bits = orig_bits
    result = {
        "name": "fixed_step",
        "command": _report.command(),
        "machine": _report.machine(),
        "model": args.model,
        "tokens": args.tokens,
        "dp_rows": args.dp_rows,
        "groups": args.groups,
        "coder": CODER,
        "types": [TYPE_NAMES[t] for t in DEFAULT_TYPES],
        "fixed": {"half_widths": list(HALF_WIDTHS), "steps": STEPS, "sizes": list(FIXED_SIZES)},
        "rows": out_rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _report.publish(name(result), result, markdown(result))
    return 0


def name(result: dict) -> str:
    """Results file and BENCHMARKS.md section of a run: by model and PCA groups studied."""
    return f"fixed_step_{result['model']}" + ("" if result["groups"] == "all" else f"_{result['groups']}")


def markdown(result: dict) -> str:
    coder = result.get("coder", "zstd")
    lines = [
        f"### Fixed-step groups: headroom on {result['model']}, PCA groups: {result['groups']} (plan space)",
        "",
        f"`{result['command']}` — {result['machine']['date']}, {result['seconds'] / 60:.1f} min. The DP on the "
        f"same {result['dp_rows']:,} sensitivity-weighted coefficient rows (of {result['tokens']:,} calibration "
        "tokens of pre-2000 speeches) with today's candidates and with fixed-step groups added (2-, 4- or 8-bit "
        "symbols, one step per group from a ladder of 20, no per-token range parameters); every candidate costed by "
        "its symbols' code length across halves of the rows plus its per-token range parameters. Error: relative "
        "squared error in the weighted PCA space (what the DP minimises). Stored: bits per token of the plan's "
        f"streams (one per type, plus the range parameters) as kvtc's coders store them ({coder} / huff4k), on the "
        "same rows. The last columns hold the stored bits equal: the plan with fixed-step groups at the largest "
        f"budget whose {coder} streams store no more than today's plan.",
        "",
        "| PCA group | kind | target (budget bits) | today: error, stored | with fixed-step groups: error, stored | "
        f"at today's stored bits ({coder}) | change |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        t, f, m = r["today_stored"], r["with_fixed_stored"], r["matched_stored"]
        lines.append(
            f"| {r['layers']} layers ({r['features']:,} features) | {r['kind']} | {r['target']:g}× "
            f"({r['budget_bits']:.0f}) | {r['today']:.4f}, {t[coder]:.0f} / {t['huff4k']:.0f} | "
            f"{r['with_fixed']:.4f}, {f[coder]:.0f} / {f['huff4k']:.0f} | {r['matched']:.4f}, {m[coder]:.0f} | "
            f"{r['matched'] / r['today'] - 1:+.0%} |"
        )
    lines += ["", f"Result: `benchmarks/results/{name(result)}.json`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
