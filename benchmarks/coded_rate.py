"""What a ratio's budget counts: packed bits (the paper's rule, kvtc's default) or the bits a blob stores.

With ``rate="nominal"`` the DP spends ``16·p/CR`` bits per token on packed symbols and range parameters, and the
entropy coder's gain (about 1.1x) comes on top: a 16x target stores about 17.5x. With ``rate="coded"``
(``kvtc calibrate --rate coded``) each group costs the bits it is expected to store (each component's symbol
entropy on the calibration rows, its range parameters at full width), so the target is what a blob stores and
the coder's gain buys quality instead. This study codes the same windows with both, per model, from calibrations
that differ only in that field (the embedded default's recipe, 100,000 tokens of the pre-2000 speeches; the coded
one is built here unless ``--coded MODEL=PATH`` names it).

Storage round trip as ``kvtc eval``'s, on ``--windows`` windows of 2,048 + 256 tokens of the speeches from 2000 on
and of Wikipedia (seed 0). Writes benchmarks/results/coded_rate.json and the ``coded_rate`` section of BENCHMARKS.md.
Usage: ``python benchmarks/coded_rate.py [--models gemma3 smollm2] [--windows 4] [--coded gemma3=g3.safetensors] [--int1s]``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import _report
from kvtc import assets
from kvtc.calibration import Calibration, Recipe, load_calibration
from kvtc.calibration.dp import DEFAULT_TYPES
from kvtc.eval.methods import KVTC
from kvtc.integrations.hf_calibrate import calibrate_model
from kvtc.quant import INT1S

TEXTS = {"sotu-2000on": "speeches from 2000 on", "wikipedia": "Wikipedia"}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="coded_rate")
    ap.add_argument("--models", nargs="+", default=["gemma3", "smollm2"])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ratios", type=float, nargs="+", default=[8, 16, 32])
    ap.add_argument("--coded", nargs="*", default=[], help="MODEL=PATH of a coded-rate calibration to reuse")
    ap.add_argument("--int1s", action="store_true", help="also a coded-rate calibration whose DP may use int1s")
    ap.add_argument("--coded-int1s", nargs="*", default=[], help="MODEL=PATH of that calibration to reuse")
    args = ap.parse_args(argv)
    given = {"coded": dict(item.split("=", 1) for item in args.coded)}
    given["coded+int1s"] = dict(item.split("=", 1) for item in args.coded_int1s)
    recipes = {"coded": Recipe(rate="coded")}
    if args.int1s or given["coded+int1s"]:
        recipes["coded+int1s"] = Recipe(rate="coded", types=DEFAULT_TYPES + (INT1S,))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    rows, cals = [], {}
    for name in args.models:
        model, tok = assets.load_model(name)
        variants = {"nominal": load_calibration("default", model=name, progress=False)}
        for label, recipe in recipes.items():
            if name in given[label]:
                variants[label] = Calibration.load(given[label][name])
            else:
                texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
                variants[label] = calibrate_model(model, tok, texts, recipe, model_id=name, progress=True)
        cals[name] = {label: cal.fingerprint for label, cal in variants.items()}
        methods = []
        for rate, cal in variants.items():
            methods += [KVTC(cal, r, name=f"{rate}", label=f"{rate} {r:g}x") for r in args.ratios]
        for text, m, figures in _report.roundtrip_rows(model, tok, methods, list(TEXTS), args.windows):
            rows.append({"model": name, "text": text, "rate": m.name, "target": m.ratio, **figures})
    result = {
        "name": "coded_rate",
        "command": _report.command(),
        "machine": _report.machine(),
        "windows": args.windows,
        "calibrations": cals,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _report.publish("coded_rate", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    m = result["machine"]
    cals = "; ".join(
        f"{k}: " + ", ".join(f"{label} {fp}" for label, fp in v.items()) for k, v in result["calibrations"].items()
    )
    lines = [
        "### What a ratio's budget counts: packed bits or stored bits",
        "",
        f"`{result['command']}` — {m['date']}, {result['seconds'] / 60:.1f} min; {m['cpu']}. Storage round trip of "
        f"{result['windows']} windows of 2,048 + 256 tokens of each held-out text; each model's default calibration "
        '(`rate="nominal"`) against the same recipe with `rate="coded"` (and with `--int1s`, also the 1-bit type) '
        f"({cals}); a `--coded` file is `kvtc calibrate --model MODEL --rate coded --out FILE`.",
        "",
        "| model | coded text | rate | target | ratio | Δppl | KL(exact‖lossy) | top-1 agree | K rel. err | V rel. err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {TEXTS[r['text']]} | {r['rate']} | {r['target']:g}× | " + _report.roundtrip_cells(r)
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
