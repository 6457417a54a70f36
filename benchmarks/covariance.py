"""Covariance accumulation of a calibration, against the way it was done before, in the same run.

    python benchmarks/covariance.py [--features 5760] [--rows 1020] [--chunks 16] [--threads 2]

The exact PCA streams every calibration window's centred rows ``c`` into a covariance (SmolLM2's default: 98
windows of 1,020 coded rows x 5,760 features, per kind). Before: one full float32 product ``cᵀc`` per chunk,
converted to float64 and added to the total (two passes over a p x p float64 matrix per chunk). Now
(:class:`~kvtc.calibration.pca.CovarianceAccumulator`): the upper triangle only, in row panels, added in place
into a float32 running sum by the product itself (beta = 1), folded into float64 every few chunks. Both are timed
on the same random rows; the covariances they give are compared. Writes ``results/covariance.json`` and the
"covariance" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, machine, table, update_section, write_json  # noqa: E402
from kvtc.calibration.pca import FOLD_CHUNKS, GRAM_PANELS, CovarianceAccumulator  # noqa: E402


def before(chunks: list[torch.Tensor], p: int) -> torch.Tensor:
    """The previous accumulation: a full float32 product per chunk, added to a float64 total."""
    pivot = chunks[0].mean(0)
    outer = torch.zeros(p, p, dtype=torch.float64)
    for rows in chunks:
        c = rows - pivot
        outer += (c.T @ c).double()
    return outer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--features", type=int, default=5760, help="p: SmolLM2's 30 layers x 3 heads x 64")
    ap.add_argument("--rows", type=int, default=1020, help="rows per chunk: one calibration window's coded tokens")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    p = args.features
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(p, p, generator=g) / p**0.5
    chunks = [torch.randn(args.rows, p, generator=g) @ mix + 0.5 for _ in range(args.chunks)]

    before(chunks[:1], p)  # warm-up
    t = time.perf_counter()
    old = before(chunks, p)
    old_s = time.perf_counter() - t

    acc = CovarianceAccumulator(p)
    acc.update(chunks[0])  # warm-up, then a fresh accumulator
    acc = CovarianceAccumulator(p)
    t = time.perf_counter()
    for rows in chunks:
        acc.update(rows)
    new = acc.gram()
    new_s = time.perf_counter() - t
    err = float((new - old).abs().max() / old.abs().max())

    n = args.chunks
    rows = [
        {"method": "before: full float32 product + float64 add per chunk", "s per chunk": old_s / n, "speed-up": 1.0},
        {
            "method": f"now: upper triangle in {GRAM_PANELS} panels, float32 in place, float64 every {FOLD_CHUNKS}",
            "s per chunk": new_s / n,
            "speed-up": old_s / new_s,
        },
    ]
    info = machine()
    data = {
        "command": command(),
        "machine": info,
        "features": p,
        "rows": args.rows,
        "chunks": n,
        "threads": args.threads,
    }
    data.update(before_s=old_s, now_s=new_s, speedup=old_s / new_s, max_rel_diff=err)
    write_json("covariance", data)
    md = (
        "### Covariance accumulation (exact PCA), before and now in the same run\n\n"
        f"`{command()}` — {info.get('cpu', 'CPU')}, {args.threads} threads, {info.get('date', '')}. "
        f"{n} chunks of {args.rows:,} rows x {p:,} features (one calibration window of SmolLM2 per chunk and kind; "
        "its default calibration accumulates 98 per kind).\n\n"
        + table(rows, ["method", "s per chunk", "speed-up"])
        + f"\n\nLargest difference between the two covariances: {err:.1e} of the largest entry (float32 rounding). "
        f"Over the default calibration's 196 chunks (98 per kind) that is {196 * (old_s - new_s) / n:.0f} s less.\n"
    )
    update_section("covariance", md)
    print(md)


if __name__ == "__main__":
    main()
