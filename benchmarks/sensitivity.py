"""Sensitivity weighting: the paper's plain squared error against Fisher-weighted PCA + DP, on an embedded model
(``--model``: SmolLM2-135M by default, or Gemma-3-270M).

One set of calibration rows (``--tokens`` of the pre-2000 speeches) and the sensitivity measured on
``--sensitivity-windows`` windows of the same speeches (the mean squared loss gradient per cached feature) feed
calibrations that differ only in how features are weighted (``--variants``, see ``VARIANTS``): none (the paper's
plain squared error), per (layer, KV head), per feature (the default of ``kvtc calibrate``), per feature with
labels drawn from the model (the true rather than the empirical Fisher), per feature with keys and values
normalised apart.

Each codes the middle tokens of ``--windows`` Wikipedia windows (the windows ``kvtc eval`` scores, seed 0) at 8×
and 16×, and as many windows of the speeches from 2000 on, scored as ``kvtc eval``'s storage round trip: next-token KL against the exact cache, perplexity change,
top-1 agreement, K/V relative errors. Writes benchmarks/results/sensitivity.json and the ``sensitivity`` section
of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import _report
from kvtc import assets
from kvtc.calibration import Recipe, fit_calibration, sensitivity_scales
from kvtc.calibration.fit import DEFAULT_SENSITIVITY_FLOOR
from kvtc.eval.methods import KVTC
from kvtc.integrations.hf import describe_model
from kvtc.integrations.hf_calibrate import collect_rows, measure_sensitivity

TEXTS = {"sotu-2000on": "speeches from 2000 on", "wikipedia": "Wikipedia"}
#: variant -> (description, resolution or None, Fisher labels, normalisation: "joint" = one constant over keys and
#: values and the K/V split on summed weighted errors; "kind" = each kind to mean 1, split on relative errors)
MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma-3-270M"}
VARIANTS = {
    "none": ("none (the paper's squared error)", None, None, None),
    "head": ("per (layer, KV head), joint", "head", "text", "joint"),
    "feature": ("per feature, joint", "feature", "text", "joint"),
    "feature-model": ("per feature, joint, labels drawn from the model (true Fisher)", "feature", "model", "joint"),
    "feature-kind": ("per feature, per kind", "feature", "text", "kind"),
    "feature-kind-model": ("per feature, per kind, labels drawn from the model", "feature", "model", "kind"),
    "feature-kind-v1": ("per feature, per kind, values ×1", "feature", "text", "kind"),
}
#: the values' weight in the K/V split of each variant (the library's default where not named)
VALUE_WEIGHTS = {"feature-kind-v1": 1.0}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="sensitivity")
    ap.add_argument("--model", default="smollm2", help="an embedded model: smollm2 (default) or gemma3")
    ap.add_argument("--tokens", type=int, default=30_000)
    ap.add_argument("--sensitivity-windows", type=int, default=8)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ratios", type=float, nargs="+", default=[8, 16])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--name", default="sensitivity", help="results/NAME.json and the NAME section of BENCHMARKS.md")
    ap.add_argument("--render", action="store_true", help="re-render results/NAME.json into BENCHMARKS.md, no run")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads((_report.RESULTS / f"{args.name}.json").read_text())
        _report.publish(args.name, result, markdown(result))
        return 0
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = assets.load_model(args.model)
    layout, rope = describe_model(model)
    texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
    fishers = {
        lab: measure_sensitivity(model, tok, texts, windows=args.sensitivity_windows, progress=False, labels=lab)
        for lab in {VARIANTS[v][2] for v in args.variants if VARIANTS[v][2]}
    }
    rows = list(collect_rows(model, tok, texts, args.tokens, progress=False))
    methods = []
    for name in args.variants:
        _, resolution, labels, norm = VARIANTS[name]
        recipe, scales = Recipe(ratios=args.ratios), None
        if resolution:
            scales = sensitivity_scales(
                fishers[labels], resolution, DEFAULT_SENSITIVITY_FLOOR, layout.head_dim, normalize=norm
            )
            if norm == "joint":
                recipe = recipe.replace(split_errors="weighted", value_weight=1.0)
            if name in VALUE_WEIGHTS:
                recipe = recipe.replace(value_weight=VALUE_WEIGHTS[name])
        cal = fit_calibration(layout, rows, recipe, feature_scale=scales, rope=rope.to_dict())
        methods += [KVTC(cal, r, name=name, label=f"{name} {r:g}x") for r in args.ratios]
    del rows
    out_rows = [
        {"text": text, "weighting": m.name, "target": m.ratio, **figures}
        for text, m, figures in _report.roundtrip_rows(model, tok, methods, list(TEXTS), args.windows)
    ]
    result = {
        "name": args.name,
        "command": _report.command(),
        "machine": _report.machine(),
        "model": args.model,
        "tokens": args.tokens,
        "sensitivity_windows": args.sensitivity_windows,
        "windows": args.windows,
        "floor": DEFAULT_SENSITIVITY_FLOOR,
        "rows": out_rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _report.publish(args.name, result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        f"### Sensitivity weighting ({MODEL_NAMES.get(result.get('model', 'smollm2'), result.get('model'))})",
        "",
        f"`{result['command']}` — {result['machine']['date']}, {result['seconds'] / 60:.1f} min. Calibrations "
        f"from the same {result['tokens']:,} tokens of pre-2000 speeches, differing only in the feature weights "
        f"(the mean squared loss gradient per cached feature, measured on {result['sensitivity_windows']} windows "
        f"of 2,048 + 256 tokens of the same speeches; floor {result['floor']:g} of the mean), scored on "
        f"{result['windows']} windows of 2,048 + 256 tokens of each held-out text (the Wikipedia ones are those "
        "`kvtc eval` scores) as `kvtc eval`'s storage round trip. The weighted rows spend their "
        "bits where the loss feels them, so their plain K/V relative errors are larger and their KL smaller.",
        "",
        "| coded text | weighting | target | ratio | Δppl | KL(exact‖lossy) | top-1 agree | K rel. err | V rel. err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {TEXTS[r['text']]} | {VARIANTS[r['weighting']][0]} | {r['target']:g}× | {r['ratio']:.2f}× | {r['delta_ppl_pct']:+.2f}% | "
            f"{r['kl']:.5f} | {r['top1_agreement']:.3f} | {r['k_rel_error']:.3f} | {r['v_rel_error']:.3f} |"
        )
    lines += ["", f"Result: `benchmarks/results/{result.get('name', 'sensitivity')}.json`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
