"""Which pair of tier targets should a token-adaptive blob use? Gemma-3-270M's next-token KL per (target, high/low).

A tiered blob (:mod:`kvtc.codec.tiers`) codes the share of each group's middle tokens attention reads most with the
plan of a ``high``-quality target and the rest with a ``low`` one, the share chosen so that the blob stores what the
plain target stores. The default pair is ``target/2`` and ``3·target/2``. This study codes the same windows with
other pairs through the real codec (``Codec(..., tiers=(high, low))``: every byte counted, the ranking the codec
computes) and reports KL beside the plain (one-plan) blob and KIVI 2-bit, measured in the same run.

It tunes on text the acceptance eval does not read: by default the speeches from 2000 on and Wikipedia windows drawn
with another seed than ``kvtc eval``'s. Each pair's ratios must be plans of the calibration (``--calibration``, by
default the model's default one; ``kvtc calibrate --ratios`` adds plans).
Usage: ``python benchmarks/tier_pairs.py [--model gemma3] [--pairs 32:16/48 32:16/96] [--windows 4]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

import _report
from kvtc import assets
from kvtc.calibration import Calibration, load_calibration
from kvtc.eval.methods import KIVI, KVTC

TEXTS = {"sotu-2000on": "speeches from 2000 on", "wikipedia": "Wikipedia"}


def parse_pair(spec: str) -> tuple[float, Any]:
    """``target`` (one plan), ``target:high/low`` (two tiers), ``target:two`` (the default two tiers, container
    version 3) or ``target:auto`` (the codec's default: the rate ladder)."""
    if ":" not in spec:
        return float(spec), "none"
    t, rest = spec.split(":")
    if rest in ("two", "auto"):
        return float(t), rest
    hi, lo = (float(x) for x in rest.split("/"))
    return float(t), (hi, lo)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tier_pairs")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--calibration", default=None, help="a calibration file (default: the model's default)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seed", type=int, default=11, help="window seed (kvtc eval draws with seed 0)")
    ap.add_argument("--texts", nargs="+", default=list(TEXTS))
    ap.add_argument("--pairs", nargs="+", default=["32", "32:16/48", "32:16/64", "32:16/96", "32:24/64"])
    ap.add_argument("--section", help="the BENCHMARKS.md section and result file (default: tier_pairs[_model])")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = assets.load_model(args.model, dtype=torch.float32)
    cal = (
        Calibration.load(args.calibration)
        if args.calibration
        else load_calibration("default", model=args.model, progress=False)
    )
    methods: list[Any] = [KIVI(2)]
    for spec in args.pairs:
        t, tiers = parse_pair(spec)
        label = f"kvtc {t:g}x" + (
            "" if tiers == "none" else f" {tiers}" if isinstance(tiers, str) else " {:g}/{:g}".format(*tiers)
        )
        methods.append(KVTC(cal, t, name=spec, label=label, tiers=tiers))
    rows = []
    for text, m, s in _report.heldout_roundtrips(model, tok, methods, args.texts, args.windows, args.seed):
        rows.append({"text": text, "method": m.label, **{k: s.get(k) for k in _report.ROUNDTRIP_KEYS}})
        print(rows[-1], flush=True)
    result = {
        "name": "tier_pairs",
        "command": _report.command(),
        "machine": _report.machine(),
        "model": args.model,
        "windows": args.windows,
        "seed": args.seed,
        "calibration": cal.fingerprint,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    # one section per model: gemma3's keeps the plain name
    name = args.section or ("tier_pairs" if args.model == "gemma3" else f"tier_pairs_{args.model}")
    result["section"] = name
    _report.publish(name, result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        f"### {result['model']}: which tier targets a token-adaptive blob should use",
        "",
        f"`{result['command']}` — {result['machine']['date']}, {result['seconds'] / 60:.1f} min. Calibration "
        f"{result['calibration']}; {result['windows']} windows (seed {result['seed']}, not the eval's) of 2,048 + 256 "
        "tokens of each text; every blob through the real codec (bytes counted as `kvtc eval` counts them), KIVI "
        "2-bit in the same run.",
        "",
        "| text | method (target, high / low) | ratio | Δppl | KL(exact‖lossy) | top-1 agree | K rel. err | V rel. err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {TEXTS.get(r['text'], r['text'])} | {r['method']} | " + _report.roundtrip_cells(r))
    lines += ["", f"Result: `benchmarks/results/{result['section']}.json`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
