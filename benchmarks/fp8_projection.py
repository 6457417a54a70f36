"""The GPU codec's projection primitives at the Llama-3.1-8B benchmark shape, each alone (GPU only).

Decode: per sequence, ``[8,060 × k16] @ [k16 × 32,768]`` with ``torch._scaled_mm`` (row-wise scales of one, the
mean as the epilogue's bias, the output a view of the KV tensor), with and without fast accumulation, and the
same in bf16 (``addmm``); one layer's columns (N = 1,024) as ``decode_layers`` runs it. Encode: ``[64,480 × 32,768]
@ [32,768 × k16]``. The one-pass fp8 operand kernel (``rows_to_fp8``) and the GPU CRC-32 (``region_crcs``) on the
sizes a benchmark blob has. Prints one JSON object; ``python benchmarks/fp8_projection.py --out results.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import _report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def timed(fn, reps: int = 10) -> float:
    return _report.cuda_timed(fn, reps)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8060)
    ap.add_argument("--features", type=int, default=32768)
    ap.add_argument("--k", type=int, default=10048)
    ap.add_argument("--crc-mb", type=int, default=590)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure", file=sys.stderr)
        return 0
    from kvtc.kernels.triton_crc import region_crcs
    from kvtc.kernels.triton_fp8 import rows_to_fp8

    B, m, p, k = args.batch, args.rows, args.features, args.k
    T = m + 132
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [B, m, k, p]}
    dev = "cuda"
    a = (torch.randn(B * m, k, device=dev) * 4).to(torch.float8_e4m3fn)
    bt = (torch.randn(p, k, device=dev) * 4).to(torch.float8_e4m3fn)  # [p, k] row-major = [k, p] column-major
    b = bt.T
    ones = torch.ones(B * m, 1, device=dev)
    sb = torch.rand(1, p, device=dev) + 0.5
    bias = torch.randn(p, device=dev).to(torch.bfloat16)
    full = torch.empty(B, T, p, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * B * m * k * p

    def dec(fast: bool, with_bias: bool, cols: tuple[int, int] = (0, p)):
        c0, c1 = cols

        def run():
            for s in range(B):
                o = full[s, 4 : 4 + m, c0:c1] if (c0, c1) == (0, p) else torch.empty(m, c1 - c0, device=dev)
                kw = {"bias": bias[c0:c1]} if with_bias else {}
                if (c0, c1) == (0, p):
                    torch._scaled_mm(
                        a[s * m : (s + 1) * m], b[:, c0:c1], scale_a=ones[:m], scale_b=sb[:, c0:c1],
                        out_dtype=torch.bfloat16, use_fast_accum=fast, out=o, **kw,
                    )  # fmt: skip
                else:
                    torch._scaled_mm(
                        a[s * m : (s + 1) * m], b[:, c0:c1], scale_a=ones[:m], scale_b=sb[:, c0:c1],
                        out_dtype=torch.bfloat16, use_fast_accum=fast, **kw,
                    )  # fmt: skip

        return run

    out: dict = {}
    for fast in (False, True):
        for with_bias in (False, True):
            try:
                t = timed(dec(fast, with_bias))
                out[f"decode_fp8_fast{int(fast)}_bias{int(with_bias)}"] = {"ms": t * 1e3, "TFLOPs": flops / t / 1e12}
            except Exception as e:  # noqa: BLE001 - report what this torch lacks
                out[f"decode_fp8_fast{int(fast)}_bias{int(with_bias)}"] = {"error": repr(e)[:300]}
    try:
        layer = 1024
        t = timed(lambda: [dec(True, True, (i * layer, (i + 1) * layer))() for i in range(p // layer)], reps=3)
        out["decode_fp8_per_layer_fast1_bias1"] = {"ms": t * 1e3, "TFLOPs": flops / t / 1e12}
    except Exception as e:  # noqa: BLE001
        out["decode_fp8_per_layer_fast1_bias1"] = {"error": repr(e)[:300]}
    ab = torch.randn(B * m, k, device=dev, dtype=torch.bfloat16)
    bb = torch.randn(k, p, device=dev, dtype=torch.bfloat16)

    def dec_bf16():
        for s in range(B):
            torch.addmm(bias, ab[s * m : (s + 1) * m], bb, out=full[s, 4 : 4 + m])

    t = timed(dec_bf16)
    out["decode_bf16_addmm"] = {"ms": t * 1e3, "TFLOPs": flops / t / 1e12}
    ab = bb = None  # free before the next shapes
    x8 = (torch.randn(B * m, p, device=dev) * 4).to(torch.float8_e4m3fn)
    e8 = (torch.randn(k, p, device=dev) * 4).to(torch.float8_e4m3fn).T  # [p, k] column-major
    sk = torch.rand(1, k, device=dev) + 0.5
    for fast in (False, True):
        t = timed(
            lambda fast=fast: torch._scaled_mm(
                x8, e8, scale_a=ones, scale_b=sk, out_dtype=torch.bfloat16, use_fast_accum=fast
            )
        )
        out[f"encode_fp8_fast{int(fast)}"] = {"ms": t * 1e3, "TFLOPs": flops / t / 1e12}
    x8 = e8 = None
    kv = torch.randn(B, T, p, device=dev, dtype=torch.bfloat16)
    mean, inv = torch.randn(p, device=dev), torch.rand(p, device=dev) + 0.5
    t = timed(lambda: rows_to_fp8(kv[:, 4 : 4 + m], mean, inv))
    out["rows_to_fp8"] = {"ms": t * 1e3, "GBps_read_write": B * m * p * 3 / t / 1e9}
    kv = None
    words = torch.randint(-(2**31), 2**31 - 1, (args.crc_mb * (1 << 18),), device=dev, dtype=torch.int32)
    n = words.numel()
    regions = [(i * n // 20, 4 * (n // 20 - 3)) for i in range(20)]
    t = timed(lambda: region_crcs(words, regions), reps=5)
    out["crc32_gpu"] = {"ms": t * 1e3, "GBps": 4 * n / t / 1e9, "regions": len(regions)}
    res["results"] = out
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
