"""Quantization types: the paper's set (int2, int4, fp8 with min/max parameters) against ours, on SmolLM2-135M.

The embedded default's calibration (its basis and, per ratio and kind, the bits its plan spends) is re-planned by
the same DP with different type sets (``VARIANTS``): the paper's; plus int3; plus the scale-only types (int2s,
int3s, int4s, fp8s: one fp16 scale a token instead of a shift and a scale); all of them (the default). The DP's
errors are measured on ``--dp-rows`` rows of ``--tokens`` tokens of the pre-2000 speeches (windows of the calibration
corpus). Reported per variant and target: the DP's predicted relative error per kind (on those rows), and the
storage round trip of ``kvtc eval`` on ``--windows`` windows of 2,048 + 256 tokens of the speeches from 2000 on
(held out; the choice of the default was made on these) and of Wikipedia (the windows ``kvtc eval`` scores).
Writes benchmarks/results/quant_types.json and the ``quant_types`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import _report
from kvtc import assets
from kvtc.calibration import Calibration
from kvtc.calibration.dp import DEFAULT_TYPES, PAPER_TYPES, allocate
from kvtc.eval.greedy import replan
from kvtc.eval.methods import KIVI, KVTC
from kvtc.integrations.hf_calibrate import collect_rows, default_calibration
from kvtc.quant import FP8S, INT2S, INT3, INT3S, INT4S

TEXTS = {"sotu-2000on": "speeches from 2000 on", "wikipedia": "Wikipedia"}
VARIANTS = {
    "paper": ("the paper's: int2, int4, fp8 (min/max)", PAPER_TYPES),
    "int3": ("+ int3", PAPER_TYPES + (INT3,)),
    "scale-only": ("+ scale-only int2s, int3s, int4s, fp8s", PAPER_TYPES + (INT2S, INT3S, INT4S, FP8S)),
    "all": ("all (default)", DEFAULT_TYPES),
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="quant_types")
    ap.add_argument("--tokens", type=int, default=24_000)
    ap.add_argument("--dp-rows", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ratios", type=float, nargs="+", default=[7, 8, 16])
    ap.add_argument("--render", action="store_true", help="re-render results/quant_types.json into BENCHMARKS.md")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads((_report.RESULTS / "quant_types.json").read_text())
        _report.publish("quant_types", result, markdown(result))
        return 0
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = assets.load_model("default")
    cal = Calibration.load(default_calibration())
    rows = list(collect_rows(model, tok, assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR), args.tokens, progress=False))
    cals: dict[str, Calibration] = {}
    predicted = []
    for name, (_, types) in VARIANTS.items():

        def alloc(coeffs: torch.Tensor, budget: float, types: tuple[int, ...] = types):
            return allocate(coeffs, budget, types=types)

        cals[name] = replan(cal, rows, args.ratios, alloc, f"dp-{name}", max_rows=args.dp_rows, seed=1)
        for r in args.ratios:
            row = {"types": name, "target": r}
            for kind in ("keys", "values"):
                plan = cals[name].plan(r, kind, 0)
                row[f"{kind}_bits"] = plan.bits_per_token
                row[f"{kind}_error"] = plan.predicted_error
            predicted.append(row)
    del rows
    # relative to the paper's set at the same target (same rows, same bits)
    base = {r["target"]: r for r in predicted if r["types"] == "paper"}
    for r in predicted:
        for kind in ("keys", "values"):
            r[f"{kind}_error_vs_paper"] = r[f"{kind}_error"] / base[r["target"]][f"{kind}_error"]
    methods = [KVTC(cals[n], r, name=n, label=f"{n} {r:g}x") for n in VARIANTS for r in args.ratios] + [KIVI(4)]
    out_rows = [
        {
            "text": text,
            "types": m.name if isinstance(m, KVTC) else None,
            "method": m.label,
            "target": m.ratio if isinstance(m, KVTC) else None,
            **figures,
        }
        for text, m, figures in _report.roundtrip_rows(model, tok, methods, list(TEXTS), args.windows)
    ]
    result = {
        "name": "quant_types",
        "command": _report.command(),
        "machine": _report.machine(),
        "calibration": cal.fingerprint,
        "tokens": args.tokens,
        "dp_rows": args.dp_rows,
        "windows": args.windows,
        "predicted": predicted,
        "rows": out_rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _report.publish("quant_types", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        "### Quantization types (SmolLM2-135M)",
        "",
        f"`{result['command']}` — {result['machine']['date']}, {result['seconds'] / 60:.1f} min. The default "
        f"calibration's basis and per-kind bits, re-planned by the DP with each type set on {result['dp_rows']:,} "
        f"rows of {result['tokens']:,} tokens of the pre-2000 speeches (windows the calibration also saw). *Predicted*: the DP's squared error on "
        "those rows relative to the paper's set at the same bits (weighted by the calibration's feature scales).",
        "",
        "| types | target | keys: error vs paper's | values: error vs paper's |",
        "|---|---|---|---|",
    ]
    for r in result["predicted"]:
        lines.append(
            f"| {VARIANTS[r['types']][0]} | {r['target']:g}× | ×{r['keys_error_vs_paper']:.3f} | "
            f"×{r['values_error_vs_paper']:.3f} |"
        )
    lines += [
        "",
        f"Storage round trip on {result['windows']} windows of 2,048 + 256 tokens of each held-out text (the "
        "default was chosen on the speeches; the Wikipedia windows are those `kvtc eval` scores):",
        "",
        "| coded text | method | ratio | Δppl | KL(exact‖lossy) | top-1 agree | K rel. err | V rel. err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        name = f"{VARIANTS[r['types']][0]} {r['target']:g}×" if r.get("types") else r["method"]
        lines.append(
            f"| {TEXTS[r['text']]} | {name} | {r['ratio']:.2f}× | {r['delta_ppl_pct']:+.3f}% | "
            f"{r['kl']:.5f} | {r['top1_agreement']:.3f} | {r['k_rel_error']:.3f} | {r['v_rel_error']:.3f} |"
        )
    lines += ["", "Result: `benchmarks/results/quant_types.json`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
