"""The bf16 restore product alone, in the layouts the GPU decode could use, on one GPU.

The bf16 restore of the Llama-3.1-8B shape (8 x 8,192 tokens, 10,000 kept components of 32,768 features per kind)
is bounded by its two products ``coeffs [n, k] @ basis [k, p] + mean``. This script times that product (both
kinds, back to back, as a restore runs them) in each layout the decode could choose, to find the fastest:

* ``per_sequence_addmm``: what ``kvtc.codec.gpu_decode`` does: one ``addmm`` per sequence, written straight into
  that sequence's middle rows of the ``[B, T, p]`` output (the mean in the epilogue);
* ``per_sequence_mm``: the same without the mean (what the epilogue costs);
* ``one_addmm_temp``: one ``addmm`` over all sequences into a temporary (then a copy would be needed);
* ``basis_transposed``: the basis kept as ``[p, k]`` (so cuBLAS runs its "TN" kernels);
* ``k_padded_64`` / ``k_padded_256``: zero components appended up to a multiple of 64 / 256.

``python benchmarks/restore_gemm.py --out benchmarks/results/restore_gemm.json``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import _report


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/restore_gemm.json")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--protected", type=int, default=132, help="sink + newest tokens per sequence (not projected)")
    ap.add_argument("--k", type=int, default=10_000)
    ap.add_argument("--p", type=int, default=32_768)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    B, T, k, p = args.batch, args.tokens, args.k, args.p
    m = T - args.protected
    n = B * m
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    coeffs = {kind: torch.randn((n, k), generator=g, device=dev).to(bf) for kind in ("keys", "values")}
    basis = {kind: (torch.randn((k, p), generator=g, device=dev) / k**0.5).to(bf) for kind in ("keys", "values")}
    mean = {kind: torch.randn(p, generator=g, device=dev).to(bf) for kind in ("keys", "values")}
    out = {kind: torch.empty((B, T, p), dtype=bf, device=dev) for kind in ("keys", "values")}
    s = 4
    flops = 2 * 2 * n * k * p

    def per_sequence(bias: bool, bases=basis, cs=coeffs):
        def run():
            for kind in ("keys", "values"):
                for b in range(B):
                    a = cs[kind][b * m : (b + 1) * m]
                    o = out[kind][b, s : s + m]
                    if bias:
                        torch.addmm(mean[kind], a, bases[kind], out=o)
                    else:
                        torch.mm(a, bases[kind], out=o)

        return run

    temp = {kind: torch.empty((n, p), dtype=bf, device=dev) for kind in ("keys", "values")}

    def one_temp():
        for kind in ("keys", "values"):
            torch.addmm(mean[kind], coeffs[kind], basis[kind], out=temp[kind])

    variants = {
        "per_sequence_addmm": per_sequence(True),
        "per_sequence_mm": per_sequence(False),
        "one_addmm_temp": one_temp,
    }
    bt = {kind: basis[kind].t().contiguous().t() for kind in ("keys", "values")}
    variants["basis_transposed"] = per_sequence(True, bt)
    for align in (64, 256):
        kp = -(-k // align) * align
        if kp != k:
            bp = {kind: torch.cat([basis[kind], basis[kind].new_zeros((kp - k, p))]) for kind in basis}
            cp = {kind: torch.nn.functional.pad(coeffs[kind], (0, kp - k)) for kind in coeffs}
            variants[f"k_padded_{align}"] = per_sequence(True, bp, cp)
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "shape": {"batch": B, "middle_tokens": m, "k": k, "p": p, "TFLOP_both_kinds": flops / 1e12},
        "variants": {},
    }
    for name, fn in variants.items():
        t = _report.cuda_timed(fn, args.reps)
        res["variants"][name] = {"ms": round(t * 1e3, 2), "TFLOPs": round(flops / t / 1e12, 1)}
        print(name, res["variants"][name], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
