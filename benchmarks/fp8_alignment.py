"""How the fp8 reconstruction matmul's speed depends on the padded component count (GPU only).

Times ``torch._scaled_mm`` for the decode shape of the GPU codec benchmark (Llama-3.1-8B: 8,060 middle tokens a
sequence, p = 32,768 features) at component counts k padded to multiples of 16, 64 and 128, and the bf16 matmul of the
same shape. Prints one JSON object; ``python benchmarks/fp8_alignment.py --out results.json``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import _report


def timed(fn, reps: int = 20) -> float:
    return _report.cuda_timed(fn, reps)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8060)
    ap.add_argument("--features", type=int, default=32768)
    ap.add_argument("--ks", type=int, nargs="+", default=[9248, 9936, 9952, 9984, 10000, 10016, 10048, 10112, 10240])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure", file=sys.stderr)
        return 0
    dev = torch.device("cuda")
    n, p = args.rows, args.features
    rows = []
    for k in args.ks:
        a = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(p, k, device=dev).to(torch.float8_e4m3fn).T  # [k, p] column-major
        sa = torch.ones(n, 1, device=dev)
        sb = torch.ones(1, p, device=dev)
        t8 = timed(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
        a16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        b16 = torch.randn(k, p, device=dev, dtype=torch.bfloat16)
        t16 = timed(lambda: a16 @ b16)
        flop = 2 * n * k * p
        rows.append(
            {
                "k": k,
                "k_mod_128": k % 128,
                "fp8_ms": t8 * 1e3,
                "fp8_TFLOPs": flop / t8 / 1e12,
                "bf16_ms": t16 * 1e3,
                "bf16_TFLOPs": flop / t16 / 1e12,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": n,
        "features": p,
        "runs": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
