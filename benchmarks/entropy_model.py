"""Entropy coding under the calibration's Gaussians: what the ``gauss`` and ``zstd-delta64`` backends save.

The same slices, the same calibration and plans, coded twice by the CPU encoder: with zstd alone (the encoder
before recipe r14) and with today's coders (each fixed-step plane under its components' Gaussians where that is
smaller, the positions as differences). One plan per token (``tiers="none"``) and the two tiers, so that both blobs
code exactly the same symbols (the rate ladder's allocation depends on the measured sizes); the ratio is bf16 bytes
of the coded tokens over every stored byte but the raw sinks and window, as ``kvtc eval`` counts it. Also each coder's
bits per symbol on the fixed-step planes and their share of the blob. Windows of 2,048 tokens of text the eval does
not read (seed 11). Writes ``benchmarks/results/entropy_model_<model>.json`` and that section of BENCHMARKS.md.
Usage: ``python benchmarks/entropy_model.py --model gemma3 --targets 16 32 64 --windows 2``. ``--timing``: instead,
the encode and decode seconds of each coder (median of 3, one slice of the first text) for one plan, two tiers and the
rate ladder, written to ``entropy_model_<model>_timing.json`` and its own section.
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
from kvtc.codec import Codec, entropy
from kvtc.eval.methods import reference_bytes
from kvtc.eval.protocols import _prefill
from kvtc.integrations.hf.adapter import extract_slice

FIXED = ("int2f", "int4f", "int8f")


def _sizes(blob: Any) -> dict[str, float]:
    f = Codec.inspect(blob)
    out = {"coded": float(f["coded_bytes"]), "fixed": 0.0, "positions": 0.0}
    for s in f["sections"]:
        if s["name"].rsplit(".", 1)[-1] in FIXED:
            out["fixed"] += s["coded"]
            out["fixed_raw"] = out.get("fixed_raw", 0.0) + s["raw"]
        if s["name"] == "positions":
            out["positions"] = float(s["coded"])
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--targets", type=float, nargs="+", default=[16, 32, 64])
    ap.add_argument("--texts", nargs="+", default=["sotu-2000on", "wikipedia"])
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--timing", action="store_true", help="time encode and decode per coder instead")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model, tok = assets.load_model(args.model, dtype=torch.bfloat16)
    cal = load_calibration("default", model=args.model, progress=False)
    if args.timing:
        return _timing(args, model, tok, cal, t0)
    acc: dict[tuple[str, float, str, str], dict[str, float]] = {}
    for text in args.texts:
        for ids in assets.token_windows(tok, assets.corpus(text), 2048, args.windows, seed=args.seed):
            kv = extract_slice(_prefill(model, ids), model)
            ref = reference_bytes(kv, 4, kv.num_tokens - 128)
            for target in args.targets:
                for tiers in ("none", "two"):
                    codec = Codec(cal, target, sinks=4, window=128, tiers=tiers)
                    for coders in ("zstd", "today"):
                        saved = entropy.MODELED_WITH
                        if coders == "zstd":
                            entropy.MODELED_WITH = frozenset()
                        try:
                            blob = codec.encode(kv)
                        finally:
                            entropy.MODELED_WITH = saved
                        a = acc.setdefault((text, target, tiers, coders), {"ref": 0.0})
                        a["ref"] += ref
                        for k, v in _sizes(blob).items():
                            a[k] = a.get(k, 0.0) + v
    rows = []
    for (text, target, tiers, coders), a in acc.items():
        if coders != "today":
            continue
        z = acc[(text, target, tiers, "zstd")]
        rows.append(
            {
                "text": text,
                "target": f"{target:g}×",
                "tokens": "one plan" if tiers == "none" else "two tiers",
                "ratio zstd": f"{z['ref'] / z['coded']:.2f}×",
                "ratio today": f"{a['ref'] / a['coded']:.2f}×",
                "blob bytes": f"{a['coded'] / z['coded'] - 1:+.1%}",
                "fixed planes share": f"{z['fixed'] / z['coded']:.0%}",
                "fixed planes coded / packed (zstd / today)": (
                    f"{z['fixed'] / z['fixed_raw']:.3f} / {a['fixed'] / a['fixed_raw']:.3f}"
                ),
                "positions bytes (zstd / delta)": f"{z['positions'] / args.windows:.0f} / {a['positions'] / args.windows:.0f}",
            }
        )
        print(rows[-1], flush=True)
    cols = list(rows[0])
    m = _report.machine()
    md = (
        f"### Entropy coding under the calibration's Gaussians ({args.model})\n\n"
        f"`{_report.command()}` — {m['date']}, {m['cpu']}, torch {m['torch']}, "
        f"{time.perf_counter() - t0:.0f} s. Calibration {cal.fingerprint[:16]}; {args.windows} windows of 2,048 tokens "
        f"(seed {args.seed}) of each text; the same blobs coded with zstd alone and with today's coders.\n\n"
        + _report.table(rows, cols)
    )
    _report.publish(
        f"entropy_model_{args.model}",
        {"command": _report.command(), "machine": m, "calibration": cal.fingerprint, "rows": rows,
         "seconds": round(time.perf_counter() - t0, 1)},
        md,
    )  # fmt: skip
    return 0


def _timing(args: Any, model: Any, tok: Any, cal: Any, t0: float) -> int:
    ids = assets.token_windows(tok, assets.corpus(args.texts[0]), 2048, 1, seed=args.seed)[0]
    kv = extract_slice(_prefill(model, ids), model)
    torch.set_num_threads(torch.get_num_threads())
    rows = []
    for target in args.targets:
        for tiers in ("none", "two", "auto"):
            row: dict[str, Any] = {"target": f"{target:g}×", "tokens": {"none": "one plan", "two": "two tiers",
                                                                         "auto": "rate ladder"}[tiers]}  # fmt: skip
            for coders in ("zstd", "today"):
                saved = entropy.MODELED_WITH
                if coders == "zstd":
                    entropy.MODELED_WITH = frozenset()
                try:
                    codec = Codec(cal, target, sinks=4, window=128, tiers=tiers)
                    enc, dec = [], []
                    for _ in range(3):
                        t = time.perf_counter()
                        blob = codec.encode(kv)
                        enc.append(time.perf_counter() - t)
                        t = time.perf_counter()
                        codec.decode(blob)
                        dec.append(time.perf_counter() - t)
                finally:
                    entropy.MODELED_WITH = saved
                row[f"encode s ({coders})"] = round(sorted(enc)[1], 3)
                row[f"decode s ({coders})"] = round(sorted(dec)[1], 3)
            rows.append(row)
            print(row, flush=True)
    m = _report.machine()
    md = (
        f"### Entropy coding under the calibration's Gaussians: time ({args.model})\n\n"
        f"`{_report.command()}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
        f"{time.perf_counter() - t0:.0f} s. One slice of 2,048 tokens (bf16) of {args.texts[0]}; the median of 3 "
        "encodes and decodes with zstd alone and with today's coders (the same calibration; the rate ladder re-encodes "
        "when its measured size is over its goal, so its passes may differ between coders).\n\n"
        + _report.table(rows, list(rows[0]))
    )
    _report.publish(
        f"entropy_model_{args.model}_timing",
        {"command": _report.command(), "machine": m, "calibration": cal.fingerprint, "rows": rows},
        md,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
