"""CPU codec throughput, per stage, on a SmolLM2-shaped slice (30 layers x 3 KV heads x 64, bf16), plus the
DP's run time at p = 5,760 (SmolLM2) and p = 32,768 (Llama-3.1-8B shape) at 16x.

    python benchmarks/codec_cpu.py [--tokens 4096] [--no-dp-large]

The calibration is synthetic (a decaying spectrum in a random rotation), fitted by the library's own
``fit_calibration``; throughput is MB/s of bf16 K+V (10^6 bytes), the median of repeated runs.
Writes benchmarks/results/codec_cpu.json, the "codec_cpu" section of BENCHMARKS.md (throughput) and its full form
with the stage and DP timings, docs/results/codec_cpu.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, machine, table, update_section, write_json  # noqa: E402
from kvtc import KVLayout, KVSlice  # noqa: E402
from kvtc.calibration import Recipe, fit_calibration  # noqa: E402
from kvtc.calibration.dp import allocate, budget_for_ratio  # noqa: E402
from kvtc.codec import Codec  # noqa: E402


def synthetic_rows(p: int, rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(p, rank, generator=g))
    sd = torch.logspace(1, -2, rank)
    mu = torch.randn(p, generator=g)

    def rows(n: int) -> torch.Tensor:
        return mu + (torch.randn(n, rank, generator=g) * sd) @ q.T + 0.01 * torch.randn(n, p, generator=g)

    return rows


def timed(fn, repeats: int):
    times, stages = [], []
    out = None
    for _ in range(repeats):
        st: dict[str, float] = {}
        t0 = time.perf_counter()
        out = fn(st)
        times.append(time.perf_counter() - t0)
        stages.append(st)
    best = min(range(repeats), key=lambda i: times[i])
    return out, statistics.median(times), stages[best]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ratio", type=float, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-dp-large", action="store_true", help="skip the p=32,768 DP timing")
    args = ap.parse_args()
    torch.manual_seed(0)

    layout = KVLayout(layers=tuple(range(30)), num_kv_heads=3, head_dim=64)
    p = layout.num_features
    krows, vrows = synthetic_rows(p, 1024, 1), synthetic_rows(p, 1024, 2)
    t0 = time.perf_counter()
    cal = fit_calibration(
        layout, [(krows(4096), vrows(4096)), (krows(4096), vrows(4096))], Recipe(ratios=(args.ratio,))
    )
    fit_s = time.perf_counter() - t0

    n = args.tokens
    shape = (1, n, 30, 3, 64)
    kv = KVSlice(layout, krows(n).reshape(shape).bfloat16(), vrows(n).reshape(shape).bfloat16(), torch.arange(n)[None])
    mb = kv.nbytes() / 1e6
    codec = Codec(cal, ratio=args.ratio)
    codec.encode(kv)  # warm-up
    blob, enc_s, enc_stages = timed(lambda st: codec.encode(kv, timings=st), args.repeats)
    out, dec_s, dec_stages = timed(lambda st: codec.decode(blob, timings=st), args.repeats)
    info = Codec.inspect(blob)
    rel = float((out.keys.float() - kv.keys.float()).square().sum() / kv.keys.float().square().sum())

    # the projection's arithmetic: [N, k] x [k, p] per kind
    kept = {kind: cal.plan(args.ratio, kind, 0).kept_components for kind in ("keys", "values")}
    flops = sum(2 * info["middle_tokens"] * k * p for k in kept.values())
    dp_rows = []
    coeffs = torch.randn(1024, p) * torch.logspace(1, -3, p)
    t0 = time.perf_counter()
    allocate(coeffs, budget_for_ratio(p, 16))
    dp_rows.append({"p": p, "components": p, "ratio": 16, "seconds": time.perf_counter() - t0})
    if not args.no_dp_large:
        p8, k8 = 32768, 10000
        coeffs = torch.randn(1024, k8) * torch.logspace(1, -3, k8)
        t0 = time.perf_counter()
        allocate(coeffs, budget_for_ratio(p8, 16))
        dp_rows.append({"p": p8, "components": k8, "ratio": 16, "seconds": time.perf_counter() - t0})

    def stage_rows(stages: dict[str, float], total: float):
        return [{"stage": k, "seconds": v, "share": v / total} for k, v in sorted(stages.items(), key=lambda x: -x[1])]

    result = {
        "machine": machine(),
        "command": command(),
        "tokens": n,
        "layout": layout.to_dict(),
        "ratio_target": args.ratio,
        "bf16_mb": mb,
        "encode_s": enc_s,
        "decode_s": dec_s,
        "encode_mb_s": mb / enc_s,
        "decode_mb_s": mb / dec_s,
        "encode_stages": enc_stages,
        "decode_stages": dec_stages,
        "projection_gflop_per_kind_total": flops / 1e9,
        "codec_ratio": info["codec_ratio"],
        "codec_ratio_before_entropy": info["codec_ratio_before_entropy"],
        "whole_cache_ratio": info["whole_cache_ratio"],
        "keys_relative_error": rel,
        "calibration_fit_s": fit_s,
        "dp": dp_rows,
    }
    write_json("codec_cpu", result)
    m = result["machine"]
    head = f"""### CPU codec throughput (SmolLM2 shape, synthetic calibration)

`{result["command"]}` — {m["date"]}, {m["cpu"]} ({m["cores"]} cores, {m["torch_threads"]} torch threads), \
Python {m["python"]}, torch {m["torch"]}, kvtc {m.get("kvtc")} ({m.get("commit", "")}). \
Slice: 1 x {n} tokens x 30 layers x 3 KV heads x 64, bf16 ({mb:.1f} MB of K+V); target {args.ratio:g}x: \
codec ratio {info["codec_ratio"]:.1f}x after entropy coding ({info["codec_ratio_before_entropy"]:.1f}x before), \
whole cache {info["whole_cache_ratio"]:.1f}x; keys relative squared error {rel:.2e}.

| | seconds (median of {args.repeats}) | MB/s of bf16 KV |
|---|---|---|
| encode | {enc_s:.3f} | {mb / enc_s:.0f} |
| decode | {dec_s:.3f} | {mb / dec_s:.0f} |
"""
    md = (
        head
        + f"""
Encode stages (best run):

{table(stage_rows(enc_stages, sum(enc_stages.values())), ["stage", "seconds", "share"])}

Decode stages (best run):

{table(stage_rows(dec_stages, sum(dec_stages.values())), ["stage", "seconds", "share"])}

The projection is {flops / 1e9:.1f} GFLOP for both kinds (kept components: keys {kept["keys"]}, values {kept["values"]}).

DP bit allocation run time (1,024 calibration rows, aligned groups {{1, 16, 64, 256, 1024}} x {{int2, int4, fp8}}, 16x):

{table(dp_rows, ["p", "components", "ratio", "seconds"])}
"""
    )
    update_section("codec_cpu", head, details=md)
    print(md)


if __name__ == "__main__":
    main()
