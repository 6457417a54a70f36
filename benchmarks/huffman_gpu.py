"""GPU ``huff4k`` entropy coder benchmark: encode and decode throughput, ratio against zstd-3, CPU twin speed.

Data: 640 MB of skewed symbol planes in 6 streams, generated on the GPU: 3 of bit-packed int2 symbols (4 a
byte, probabilities 0.05/0.45/0.45/0.05) and 3 of int4 nibble pairs (a Gaussian of sigma 2 around the
middle of 0..15, rounded), of mixed sizes, all coded in one batch.

Throughputs are raw (uncoded) bytes per second, CUDA-synchronized, the median of 5 runs after a warm-up:

* ``encode_gbps``: device tensors -> coded words on the device: :meth:`DeviceCoder.encode_device` (the
  per-block histogram kernel, per-stream sums and their D2H, code tables on the host, each block's bits
  and the D2H of the word counts, the encode kernel).
* ``decode_gbps``: coded words on the device -> decoded device tensors (the decode kernel and the read-back
  of its error flag): :meth:`DeviceCoder.decode_device`.
* ``*_kernel_gbps``: the encode / decode kernel alone (CUDA events).
* ``compress_e2e_gbps`` / ``decompress_e2e_gbps``: the full calls with host bytes on one side
  (:meth:`DeviceCoder.compress`: + D2H through pinned memory and framing; :meth:`DeviceCoder.decompress`:
  + header validation, staging into pinned memory and the H2D copy).

Before timing, a sweep over the kernels' launch settings (lanes a program, warps, bytes a vector load,
loads ahead) picks the fastest of each kernel; every setting's time is in the output.

``python benchmarks/huffman_gpu.py [--mb 640] [--out results.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvtc.coding import huffman as H  # noqa: E402
from kvtc.coding.entropy import device_coder  # noqa: E402
from kvtc.kernels import triton_huffman as K  # noqa: E402

ENCODE_SWEEP = [
    dict(lanes=32, warps=1, vec=8, prefetch=0),
    dict(lanes=32, warps=1, vec=8, prefetch=1),
    dict(lanes=64, warps=2, vec=8, prefetch=1),
    dict(lanes=64, warps=2, vec=4, prefetch=1),
    dict(lanes=128, warps=4, vec=8, prefetch=1),
    dict(lanes=128, warps=2, vec=8, prefetch=1),
]
DECODE_SWEEP = [
    dict(lanes=32, warps=1, vec=8, prefetch=0),
    dict(lanes=32, warps=1, vec=8, prefetch=1),
    dict(lanes=64, warps=2, vec=8, prefetch=1),
    dict(lanes=128, warps=4, vec=8, prefetch=0),
    dict(lanes=128, warps=4, vec=8, prefetch=1),
    dict(lanes=128, warps=2, vec=8, prefetch=1),
]
HIST_SWEEP = [
    dict(kind="histogram", warps=2),
    dict(kind="histogram", warps=4),
    dict(kind="histogram", warps=8),
    dict(kind="onehot", warps=4),
]
KEYS = ("lanes", "warps", "vec", "prefetch")


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def gen_int2(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.empty(n, dtype=torch.uint8, device="cuda")
    for i in range(0, n, 1 << 24):
        m = min(1 << 24, n - i)
        u = torch.rand(m, 4, device="cuda", generator=g)
        s = (u > 0.05).to(torch.uint8) + (u > 0.5).to(torch.uint8) + (u > 0.95).to(torch.uint8)
        out[i : i + m] = s[:, 0] | (s[:, 1] << 2) | (s[:, 2] << 4) | (s[:, 3] << 6)
    return out


def gen_int4(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.empty(n, dtype=torch.uint8, device="cuda")
    for i in range(0, n, 1 << 24):
        m = min(1 << 24, n - i)
        q = torch.randn(m, 2, device="cuda", generator=g).mul_(2.0).add_(7.5).round_().clamp_(0, 15).to(torch.uint8)
        out[i : i + m] = q[:, 0] | (q[:, 1] << 4)
    return out


def median_time(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def event_time(fn, reps: int = 5) -> float:
    fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def sweep(name: str, grid: list[dict], cfg: dict, run, total: int, extra=lambda: {}) -> list[dict]:
    """Time ``run`` under each kernel launch setting of ``grid`` (written into ``cfg``), then leave the fastest in
    ``cfg``. A setting that does not compile is recorded and skipped."""
    results = []
    for c in grid:
        try:
            cfg.update(c)
            t = median_time(run, reps=3)
            results.append({**c, "gbps": total / t / 1e9, **extra()})
            log(name, c, f"{total / t / 1e9:.1f} GB/s", extra())
        except Exception as e:  # noqa: BLE001 - record and go on
            results.append({**c, "error": repr(e)[:300]})
            log(name, c, "failed", repr(e)[:300])
    best = max((r for r in results if "gbps" in r), key=lambda r: r["gbps"])
    cfg.update({k: best[k] for k in KEYS})
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=640)
    ap.add_argument("--out", type=str, default="")
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    def dump() -> None:  # after every phase: a run cut short keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))

    import triton

    res["triton"] = triton.__version__
    coder = device_coder(H.NAME, "cuda")
    assert coder is not None, "no huff4k GPU coder (CUDA + Triton needed)"

    # 6 streams of mixed sizes summing to --mb MB (1 MB = 2**20 bytes)
    total = args.mb << 20
    weights = np.array([1.10, 0.90, 1.00, 1.05, 0.95, 1.00])
    sizes = (weights / weights.sum() * total).astype(np.int64)
    sizes[-1] += total - sizes.sum()
    sizes = [int(s) for s in sizes]
    t0 = time.perf_counter()
    streams = [gen_int2(n, i) if i % 2 == 0 else gen_int4(n, i) for i, n in enumerate(sizes)]
    torch.cuda.synchronize()
    log(f"generated {total / 1e6:.0f} MB in {time.perf_counter() - t0:.1f}s, sizes {sizes}")
    res["raw_bytes"] = total
    res["stream_sizes"] = sizes

    # the kernels alone (CUDA events) run on one contiguous copy of the streams; first the histogram kernel's
    # settings
    starts, pos = [], 0
    for n in sizes:
        starts.append(pos)
        pos += -(-n // 16) * 16
    src = torch.empty(pos, dtype=torch.uint8, device="cuda")
    for s, st in zip(streams, starts):
        src[st : st + s.numel()].copy_(s)
    nblk = [-(-n // H.BLOCK) for n in sizes]
    blk_src = torch.from_numpy(np.concatenate([st + H.BLOCK * np.arange(c) for st, c in zip(starts, nblk)])).cuda()
    blk_n = torch.from_numpy(np.concatenate([H._block_sizes(n) for n in sizes]).astype(np.int32)).cuda()
    blk_tab = torch.from_numpy(np.concatenate([np.full(c, 256 * i, np.int32) for i, c in enumerate(nblk)])).cuda()
    hs = []
    for cfg in HIST_SWEEP:
        try:
            t_h = event_time(lambda: K.block_hist(src, blk_src, blk_n, **cfg))
            hs.append({**cfg, "gbps": total / t_h / 1e9})
        except Exception as e:  # noqa: BLE001
            hs.append({**cfg, "error": repr(e)[:300]})
    res["block_hist_sweep"] = hs
    log("block_hist", hs)
    ok = [h for h in hs if "gbps" in h]
    if ok:
        best = max(ok, key=lambda h: h["gbps"])
        K.HIST_CFG.update(kind=best["kind"], warps=best["warps"])
    res["hist_cfg"] = dict(K.HIST_CFG)

    # sweep the encode kernel's launch settings
    enc = coder.encode_device(streams)
    res["encode_sweep"] = sweep(
        "encode",
        ENCODE_SWEEP,
        K.ENCODE_CFG,
        lambda: coder.encode_device(streams),
        total,
        lambda: {"breakdown": dict(coder.last)},
    )
    res["encode_cfg"] = dict(K.ENCODE_CFG)

    # final encode numbers with the best setting
    t_enc = median_time(lambda: coder.encode_device(streams))
    enc = coder.encode_device(streams)
    res["encode_gbps"] = total / t_enc / 1e9
    res["encode_breakdown_ms"] = {k: v * 1e3 for k, v in coder.last.items()}
    etab = torch.from_numpy(np.concatenate([H.encode_table(ln) for ln in enc["lengths"]])).cuda()
    words_d = torch.from_numpy(enc["words"]).cuda()
    blk_wo = torch.cumsum(words_d, 0) - words_d
    # the encode kernel alone; and again with blocks 4096 + 256 bytes apart (does the lanes' 4 KiB stride
    # alias in L1?)
    out = torch.empty_like(enc["out"])
    t_k = event_time(lambda: K.encode(src, blk_src, blk_n, blk_tab, etab, blk_wo, out))
    assert torch.equal(out, enc["out"])
    res["encode_kernel_gbps"] = total / t_k / 1e9
    nb = blk_n.numel()
    try:
        stride = H.BLOCK + 256
        pv = torch.zeros((nb, stride), dtype=torch.uint8, device="cuda")
        for (a, b), s in zip(enc["spans"], streams):
            full = s.numel() // H.BLOCK
            pv[a : a + full, : H.BLOCK].copy_(s[: full * H.BLOCK].view(full, H.BLOCK))
            if a + full < b:
                pv[a + full, : s.numel() - full * H.BLOCK].copy_(s[full * H.BLOCK :])
        psrc = torch.arange(nb, device="cuda", dtype=torch.int64) * stride
        out2 = torch.empty_like(out)
        t_p = event_time(lambda: K.encode(pv.view(-1), psrc, blk_n, blk_tab, etab, blk_wo, out2))
        assert torch.equal(out2, out)
        res["encode_kernel_padded_stride_gbps"] = total / t_p / 1e9
        del pv, out2
    except Exception as e:  # noqa: BLE001 - an experiment only
        res["encode_kernel_padded_stride_gbps"] = repr(e)[:200]
    coded_bytes = sum(H.HEAD + 2 * (b - a) + 4 * int(enc["words"][a:b].sum()) for a, b in enc["spans"])
    res["coded_bytes"] = coded_bytes
    res["ratio"] = total / coded_bytes
    log(
        "encode",
        f"{res['encode_gbps']:.1f} GB/s, kernel {res['encode_kernel_gbps']:.1f} GB/s, "
        f"padded stride {res['encode_kernel_padded_stride_gbps']}, ratio {res['ratio']:.4f}",
    )
    dump()

    # full compress (D2H + framing)
    t_c = median_time(lambda: coder.compress(streams), reps=3)
    blobs = coder.compress(streams)
    res["compress_e2e_gbps"] = total / t_c / 1e9
    res["compress_breakdown_ms"] = {k: v * 1e3 for k, v in coder.last.items()}
    assert sum(len(b) for b in blobs) == coded_bytes
    log("compress e2e", f"{res['compress_e2e_gbps']:.1f} GB/s", res["compress_breakdown_ms"])
    dump()

    # decode: sweep, then the best setting
    st = coder.stage(blobs, sizes)
    res["decode_sweep"] = sweep("decode", DECODE_SWEEP, K.DECODE_CFG, lambda: coder.decode_device(st), total)
    res["decode_cfg"] = dict(K.DECODE_CFG)
    t_dec = median_time(lambda: coder.decode_device(st))
    res["decode_gbps"] = total / t_dec / 1e9
    dec = coder.decode_device(st)
    res["decode_exact"] = all(torch.equal(a, b) for a, b in zip(dec, streams))
    outbuf = torch.empty(st["out_bytes"], dtype=torch.uint8, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    t_dk = event_time(
        lambda: K.decode(
            st["words"], st["blk_wo"], st["blk_nw"], st["blk_n"], st["blk_tab"], st["blk_out"], st["tab"], outbuf, err
        )
    )
    res["decode_kernel_gbps"] = total / t_dk / 1e9
    log(
        "decode",
        f"{res['decode_gbps']:.1f} GB/s, kernel {res['decode_kernel_gbps']:.1f} GB/s, exact {res['decode_exact']}",
    )
    t_d = median_time(lambda: coder.decompress(blobs, sizes), reps=3)
    res["decompress_e2e_gbps"] = total / t_d / 1e9
    res["decompress_breakdown_ms"] = {k: v * 1e3 for k, v in coder.last.items()}
    log("decompress e2e", f"{res['decompress_e2e_gbps']:.1f} GB/s", res["decompress_breakdown_ms"])
    dump()
    del st, dec, outbuf

    # ratio against zstd-3 on a 64 MB sample (the first 64/6 MB of every stream)
    per = (64 << 20) // len(streams)
    pieces = [s[:per] for s in streams]
    ours = coder.compress(pieces)
    host = [p.cpu().numpy().tobytes() for p in pieces]
    raw = sum(len(h) for h in host)
    try:
        import zstandard
    except ImportError:  # not on every image: carry its wheel
        zstandard = None
        res["sample"] = {"raw_bytes": raw, "huff4k_bytes": sum(map(len, ours)), "zstd3_bytes": None}
    if zstandard is not None:
        zc = zstandard.ZstdCompressor(level=3)
        t0 = time.perf_counter()
        zs = [zc.compress(h) for h in host]
        t_z = time.perf_counter() - t0
        res["sample"] = {
            "raw_bytes": raw,
            "huff4k_bytes": sum(map(len, ours)),
            "zstd3_bytes": sum(map(len, zs)),
            "huff4k_ratio": raw / sum(map(len, ours)),
            "zstd3_ratio": raw / sum(map(len, zs)),
            "huff4k_over_zstd3_size": sum(map(len, ours)) / sum(map(len, zs)),
            "zstd3_cpu_mbps_1thread": raw / t_z / 1e6,
            "per_stream_huff4k_over_zstd3": [len(a) / len(b) for a, b in zip(ours, zs)],
        }
    log("sample", res["sample"])
    dump()

    # the CPU twin on 16 MB (one core), and GPU == CPU bytes on it
    cpu_in = host[0][: 8 << 20] + host[1][: 8 << 20]
    t0 = time.perf_counter()
    cpu_enc = H.cpu_compress(cpu_in)
    t1 = time.perf_counter()
    cpu_dec = H.cpu_decompress(cpu_enc, len(cpu_in))
    t2 = time.perf_counter()
    gpu_enc = coder.compress([torch.frombuffer(bytearray(cpu_in), dtype=torch.uint8).cuda()])[0]
    res["cpu_twin"] = {
        "bytes": len(cpu_in),
        "encode_mbps": len(cpu_in) / (t1 - t0) / 1e6,
        "decode_mbps": len(cpu_in) / (t2 - t1) / 1e6,
        "round_trip_exact": cpu_dec == cpu_in,
        "gpu_bytes_identical": gpu_enc == cpu_enc,
    }
    log("cpu twin", res["cpu_twin"])

    dump()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
