"""Two levers on Gemma-3-270M's quality at 16x and 32x, measured as ``kvtc eval``'s storage round trip.

1. **One-bit coefficients** (``--types-tokens`` calibration rows of the pre-2000 speeches, sensitivity-weighted as
   by default): the DP's default quantization types against the same plus ``int1s`` (sign and a per-token scale,
   opt-in: ``kvtc calibrate --types all,int1s``), fitted on the same rows and sensitivity.
2. **Bits moved between kinds of layer** (the embedded default calibration): each kind of layer (the 15
   sliding-window ones, the 3 full-attention ones) coded with the plan of another target ratio, in pairs that store
   the same bytes at a 2,048-token context (where both kinds hold about as many coded features), e.g. full
   layers at 12x and sliding ones at 24x for 16x. kvtc codes each kind at the target ratio on its own, so that the
   stored ratio holds at every context length; this measures what that rule costs.

Each variant codes the middle tokens of ``--windows`` windows of 2,048 + 256 tokens of the speeches from 2000 on
and of Wikipedia (the windows ``kvtc eval`` scores, seed 0). Writes benchmarks/results/gemma_levers.json and the
``gemma_levers`` section of BENCHMARKS.md. Usage: ``python benchmarks/gemma_levers.py [--windows 4]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

import _report
from kvtc import assets
from kvtc.calibration import Recipe, fit_calibration, load_calibration, sensitivity_scales
from kvtc.calibration.artifact import ratio_key
from kvtc.calibration.dp import DEFAULT_TYPES
from kvtc.calibration.fit import DEFAULT_SENSITIVITY_FLOOR
from kvtc.eval.methods import KVTC
from kvtc.integrations.hf import describe_model
from kvtc.integrations.hf_calibrate import collect_rows, measure_sensitivity
from kvtc.quant import INT1S

TEXTS = {"sotu-2000on": "speeches from 2000 on", "wikipedia": "Wikipedia"}
#: (target, full-attention layers' plan ratio, sliding layers' plan ratio): equal stored bytes at 2,048 tokens
MIXES = ((16, 16, 16), (16, 12, 24), (16, 24, 12), (16, 10, 48), (32, 32, 32), (32, 24, 48), (32, 48, 24))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gemma_levers")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--types-tokens", type=int, default=30_000, help="calibration rows of the types comparison")
    ap.add_argument("--ratios", type=float, nargs="+", default=[16, 32])
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = assets.load_model("gemma3")
    layout, rope = describe_model(model)
    texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
    fisher = measure_sensitivity(model, tok, texts, progress=False)
    rows = list(collect_rows(model, tok, texts, args.types_tokens, progress=False))
    scales = sensitivity_scales(fisher, "feature", DEFAULT_SENSITIVITY_FLOOR, layout.head_dim, normalize="kind")
    methods = []
    for name, types in (("default types", DEFAULT_TYPES), ("default types + int1s", DEFAULT_TYPES + (INT1S,))):
        cal = fit_calibration(layout, rows, Recipe(ratios=args.ratios, types=types), feature_scale=scales,
                              rope=rope.to_dict())  # fmt: skip
        methods += [KVTC(cal, r, name=f"types:{name}", label=f"{name} {r:g}x") for r in args.ratios]
    del rows
    # the kinds of layer: the full-attention group is the smaller one (3 of 18 layers)
    cal = load_calibration("default", model="gemma3", progress=False)
    full = min(range(len(cal.columns)), key=lambda g: cal.columns[g].numel())
    plans = dict(cal.plans)
    for i, (_, rf, rs) in enumerate(MIXES):
        plans[ratio_key(1000 + i)] = {
            kind: [cal.plans[ratio_key(rf if g == full else rs)][kind][g] for g in range(len(cal.columns))]
            for kind in ("keys", "values")
        }
    mixed = dataclasses.replace(cal, plans=plans)
    methods += [
        KVTC(mixed, 1000 + i, name=f"mix:{t}:{rf:g}:{rs:g}", label=f"mix {t}x full {rf:g} sliding {rs:g}")
        for i, (t, rf, rs) in enumerate(MIXES)
    ]
    out_rows = []
    for text, m, figures in _report.roundtrip_rows(model, tok, methods, list(TEXTS), args.windows):
        study, *rest = m.name.split(":")
        row = {"text": text, "study": study, **figures}
        if study == "types":
            row.update(variant=rest[0], target=m.ratio)
        else:
            row.update(target=float(rest[0]), full=float(rest[1]), sliding=float(rest[2]))
        out_rows.append(row)
    result = {
        "name": "gemma_levers",
        "command": _report.command(),
        "machine": _report.machine(),
        "windows": args.windows,
        "types_tokens": args.types_tokens,
        "calibration": cal.fingerprint,
        "rows": out_rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _report.publish("gemma_levers", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    head = "| ratio | Δppl | KL(exact‖lossy) | top-1 agree | K rel. err | V rel. err |"
    lines = [
        "### Gemma-3-270M: one-bit coefficients, and bits moved between kinds of layer",
        "",
        f"`{result['command']}` — {result['machine']['date']}, {result['seconds'] / 60:.1f} min. Storage round "
        f"trip of {result['windows']} windows of 2,048 + 256 tokens of each held-out text. Types: two calibrations "
        f"from the same {result['types_tokens']:,} tokens of pre-2000 speeches and the same sensitivity, the DP "
        "choosing among the default quantization types or those plus `int1s`.",
        "",
        "| coded text | types | target | " + head[2:],
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["study"] == "types":
            lines.append(f"| {TEXTS[r['text']]} | {r['variant']} | {r['target']:g}× | " + _report.roundtrip_cells(r))
    lines += [
        "",
        f"Kinds of layer: the default calibration ({result['calibration']}), each kind coded with the plan of "
        "the ratio named; the pairs store the same bytes at this context (the first of each target is kvtc's "
        "rule: every kind at the target).",
        "",
        "| coded text | target | full-attention layers | sliding layers | " + head[2:],
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["study"] == "mix":
            lines.append(
                f"| {TEXTS[r['text']]} | {r['target']:g}× | {r['full']:g}× | {r['sliding']:g}× | "
                + _report.roundtrip_cells(r)
            )
    lines += ["", "Result: `benchmarks/results/gemma_levers.json`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
