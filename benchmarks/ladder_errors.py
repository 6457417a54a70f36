"""How a rate-ladder encode should measure a rung's error per layer: "exact" (the error taken back to every
feature) or "diagonal" (each component's squared error spread over the layers as its basis row is), against r13's
two tiers, on text the eval does not read: next-token KL and encode time, in one run.

Usage: ``python benchmarks/ladder_errors.py [--targets 32 64] [--windows 2]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

import _report
from kvtc import assets
from kvtc.calibration import load_calibration
from kvtc.codec import tiers
from kvtc.eval.methods import KIVI, KVTC

TEXTS = {"sotu-2000on": "speeches from 2000 on", "wikipedia": "Wikipedia"}


class Measured(KVTC):
    """kvtc with the ladder's per-layer errors measured one way (``tiers.LADDER_ERRORS`` while it encodes)."""

    def __init__(self, cal: Any, ratio: float, errors: str):
        super().__init__(cal, ratio, name=f"kvtc {ratio:g}x", label=f"kvtc {ratio:g}x ladder, {errors} errors")
        self.errors = errors

    def compress(self, kv, start, stop, rope):  # type: ignore[no-untyped-def]
        before, tiers.LADDER_ERRORS = tiers.LADDER_ERRORS, self.errors
        try:
            return super().compress(kv, start, stop, rope)
        finally:
            tiers.LADDER_ERRORS = before


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ladder_errors")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seed", type=int, default=11, help="window seed (kvtc eval draws with seed 0)")
    ap.add_argument("--texts", nargs="+", default=list(TEXTS))
    ap.add_argument("--targets", type=float, nargs="+", default=[32, 64])
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = assets.load_model(args.model, dtype=torch.float32)
    cal = load_calibration("default", model=args.model, progress=False)
    methods: list[Any] = [KIVI(2)]
    for t in args.targets:
        methods.append(KVTC(cal, t, name=f"kvtc {t:g}x", label=f"kvtc {t:g}x two tiers (r13)", tiers="two"))
        methods += [Measured(cal, t, "diagonal"), Measured(cal, t, "exact")]
    rows = []
    for text, m, s in _report.heldout_roundtrips(model, tok, methods, args.texts, args.windows, args.seed):
        enc = m.timer.seconds.get("encode") if hasattr(m, "timer") else None
        row = {"text": text, "method": m.label, **{k: s.get(k) for k in _report.ROUNDTRIP_KEYS}}
        row["encode_s_per_window"] = None if enc is None else round(enc / args.windows, 2)
        rows.append(row)
        print(rows[-1], flush=True)
        if hasattr(m, "timer"):
            m.timer = type(m.timer)()  # each text's encode time on its own
    result = {
        "name": "ladder_errors",
        "command": _report.command(),
        "machine": _report.machine(),
        "model": args.model,
        "windows": args.windows,
        "seed": args.seed,
        "calibration": cal.fingerprint,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _report.publish("ladder_errors", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        f"### {result['model']}: how the rate ladder measures a rung's error per layer",
        "",
        f"`{result['command']}` — {result['machine']['date']}, {result['seconds'] / 60:.1f} min, "
        f"{result['machine'].get('cpu', '')}. Calibration {result['calibration']}; {result['windows']} windows "
        f"(seed {result['seed']}, not the eval's) of 2,048 + 256 tokens of each text; KIVI 2-bit in the same run. "
        "Encode: seconds per window on the CPU, in the same run (the machine's other load included).",
        "",
        "| text | method | ratio | Δppl | KL(exact‖lossy) | top-1 agree | K rel. err | V rel. err | encode s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        enc = "" if r["encode_s_per_window"] is None else f"{r['encode_s_per_window']:.2f}"
        lines.append(
            f"| {TEXTS.get(r['text'], r['text'])} | {r['method']} | " + _report.roundtrip_cells(r) + f" {enc} |"
        )
    lines += ["", "Result: `benchmarks/results/ladder_errors.json`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
