"""Fixed-step quantization types in the codec, measured as ``kvtc eval``'s storage round trip.

``int2f`` / ``int4f`` / ``int8f`` (:mod:`kvtc.quant`) code a PCA coefficient as ``clamp(round(x / step), -h, h)``
with one step per component fixed at calibration time, and no per-token range parameters; the DP chooses each
kept component's step from a ladder, costing every rung by its expected stored bits (``benchmarks/fixed_step.py``
measured the plan-space headroom). Three calibrations from the same ``--tokens`` rows of the pre-2000 speeches and the
same sensitivity: the previous default recipe (r9: its types, coded rate), the same types with the stored rate, and
r10 (those types plus the fixed-step ones, stored rate); each codes the middle tokens of
``--windows`` windows of 2,048 + 256 tokens of the speeches from 2000 on and of Wikipedia (the windows ``kvtc eval``
scores, seed 0). Writes benchmarks/results/fixed_types_<model>.json and that section of BENCHMARKS.md. Usage:
``python benchmarks/fixed_types.py [--model gemma3|smollm2] [--windows 4] [--tokens 30000]``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import _report
from kvtc import assets
from kvtc.calibration import Recipe, fit_calibration, sensitivity_scales
from kvtc.calibration.dp import R9_TYPES
from kvtc.calibration.fit import DEFAULT_SENSITIVITY_FLOOR
from kvtc.eval.methods import KVTC
from kvtc.integrations.hf import describe_model
from kvtc.integrations.hf_calibrate import collect_rows, measure_sensitivity
from kvtc.quant import INT2F, INT4F, INT8F

TEXTS = {"sotu-2000on": "speeches from 2000 on", "wikipedia": "Wikipedia"}
#: the r9 recipe (the previous default), r9 with the stored rate, and r10 (its fixed-step types and stored rate)
VARIANTS = {
    "r9: previous types, coded rate": {"types": R9_TYPES, "rate": "coded"},
    "r9 types, stored rate": {"types": R9_TYPES, "rate": "stored"},
    "r10: fixed-step types, stored rate": {"types": R9_TYPES + (INT2F, INT4F, INT8F), "rate": "stored"},
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="fixed_types")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=30_000, help="calibration rows of both calibrations")
    ap.add_argument("--ratios", type=float, nargs="+", default=[16, 24, 32])
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = assets.load_model(args.model)
    layout, rope = describe_model(model)
    texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
    fisher = measure_sensitivity(model, tok, texts, progress=False)
    rows = list(collect_rows(model, tok, texts, args.tokens, progress=False))
    scales = sensitivity_scales(fisher, "feature", DEFAULT_SENSITIVITY_FLOOR, layout.head_dim, normalize="kind")
    methods, fingerprints, fit_seconds = [], {}, {}
    for name, choice in VARIANTS.items():
        t1 = time.perf_counter()
        cal = fit_calibration(layout, rows, Recipe(ratios=args.ratios, **choice), feature_scale=scales,
                              rope=rope.to_dict())  # fmt: skip
        fit_seconds[name] = round(time.perf_counter() - t1, 1)
        fingerprints[name] = cal.fingerprint
        methods += [KVTC(cal, r, name=name, label=f"{name} {r:g}x") for r in args.ratios]
        print(f"{name}: fitted in {fit_seconds[name]:.0f} s", flush=True)
    del rows
    out_rows = []
    for text, m, figures in _report.roundtrip_rows(model, tok, methods, list(TEXTS), args.windows):
        out_rows.append({"text": text, "variant": m.name, "target": m.ratio, **figures})
        print(text, m.label, figures, flush=True)
    result = {
        "name": f"fixed_types_{args.model}",
        "command": _report.command(),
        "machine": _report.machine(),
        "model": args.model,
        "windows": args.windows,
        "tokens": args.tokens,
        "calibrations": fingerprints,
        "fit_seconds": fit_seconds,
        "rows": out_rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _report.publish(result["name"], result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        f"### Fixed-step types in the codec ({result['model']})",
        "",
        f"`{result['command']}` — {result['machine']['date']}, {result['seconds'] / 60:.1f} min. Storage round trip "
        f"of {result['windows']} windows of 2,048 + 256 tokens of each held-out text. Three calibrations from the same "
        f"{result['tokens']:,} tokens of pre-2000 speeches and the same sensitivity: the previous default recipe "
        '(r9), the same with budgets fitted to the bits its sections store (`rate="stored"`), and r10, which adds '
        "the fixed-step types `int2f` / `int4f` / `int8f` (fitted in "
        + " / ".join(f"{s:.0f} s" for s in result["fit_seconds"].values())
        + ").",
        "",
        "| coded text | types | target | ratio | Δppl | KL(exact‖lossy) | top-1 agree | K rel. err | V rel. err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {TEXTS[r['text']]} | {r['variant']} | {r['target']:g}× | " + _report.roundtrip_cells(r))
    lines += ["", f"Result: `benchmarks/results/{result['name']}.json`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
