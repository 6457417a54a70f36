"""Time to first token on CPU: restoring a compressed SmolLM2 cache vs recomputing the prefix, side by side.

    python benchmarks/ttft_cpu.py [--context 4096] [--ratio 16] [--repeats 3] [--calibration FILE]

A held-out State of the Union window (2000 on) of ``--context`` tokens is prefilled once; its cache is compressed
at ``--ratio`` with the default calibration (built on first use) and written to disk. Then, alternating, ``--repeats``
times each: *restore* = read the file, decode, rebuild the ``DynamicCache``, run the first new token; *recompute* =
prefill the context plus that token from nothing. Both end with the same next-token logits. Reports medians, the
decode stages, the blob's sizes and ratios. Writes benchmarks/results/ttft_cpu.json, the "ttft_cpu" section of
BENCHMARKS.md and its full form (stages, sizes), docs/results/ttft_cpu.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, machine, table, update_section, write_json  # noqa: E402
from kvtc import assets  # noqa: E402
from kvtc.calibration.artifact import Calibration  # noqa: E402
from kvtc.codec import Codec  # noqa: E402
from kvtc.integrations.hf import compress_cache, load_blob, restore_cache, save_blob  # noqa: E402
from kvtc.integrations.hf_calibrate import default_calibration  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--ratio", type=float, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calibration", type=Path, help="calibration file (default: the embedded default's)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cal = Calibration.load(args.calibration or default_calibration(progress=True))
    model, tok = assets.load_model("default")
    window = assets.token_windows(tok, assets.sotu_texts(since=assets.SOTU_SPLIT_YEAR), args.context + 1, 1, seed=0)
    ctx, first = window[:, : args.context], window[:, args.context :]

    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        cache = model(ctx, use_cache=True).past_key_values
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        blob = compress_cache(cache, model, Codec(cal, ratio=args.ratio))
        encode_s = time.perf_counter() - t0
        path = save_blob(Path(tmp) / "context.kvtc", blob)
        del cache

        restore, recompute, stages = [], [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            logits_full = model(torch.cat([ctx, first], dim=1), use_cache=True).logits[:, -1]
            recompute.append(time.perf_counter() - t0)

            st: dict[str, float] = {}
            t0 = time.perf_counter()
            data = load_blob(path)
            st["read"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            restored = restore_cache(data, model, cal, timings=st)
            st["decode + rebuild"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            logits = model(first, past_key_values=restored, use_cache=True).logits[:, -1]
            st["first token"] = time.perf_counter() - t1
            restore.append(time.perf_counter() - t0)
            stages.append(st)
            del restored

    info = Codec.inspect(blob)
    med_restore, med_recompute = statistics.median(restore), statistics.median(recompute)
    same_top1 = bool(int(logits.argmax()) == int(logits_full.argmax()))
    result = {
        "machine": machine(),
        "command": command(),
        "context_tokens": args.context,
        "target_ratio": args.ratio,
        "calibration": cal.fingerprint,
        "calibration_tokens": cal.stats.get("samples"),
        "restore_s": restore,
        "recompute_s": recompute,
        "median_restore_s": med_restore,
        "median_recompute_s": med_recompute,
        "speedup": med_recompute / med_restore,
        "restore_stages_s": stages[min(range(len(restore)), key=lambda i: restore[i])],
        "first_token_top1_matches_recompute": same_top1,
        "prefill_once_s": prefill_s,
        "encode_s": encode_s,
        "bf16_bytes": info["original_bytes"],
        "blob_bytes": len(blob),
        "codec_ratio": info["codec_ratio"],
        "whole_cache_ratio": info["whole_cache_ratio"],
    }
    write_json("ttft_cpu", result)
    stage_txt = ", ".join(f"{k} {v:.2f} s" for k, v in result["restore_stages_s"].items())
    md = "\n".join(
        [
            "### Time to first token on CPU: restore a compressed cache vs recompute the prefix",
            "",
            f"SmolLM2-135M-Instruct (fp32 weights, bf16 KV storage), {args.context}-token held-out context, "
            f"{args.ratio:g}x target (calibration of {cal.stats.get('samples', '?')} tokens), {args.threads} threads, "
            f"median of {args.repeats} alternating runs. "
            f"{result['machine']['cpu']}, {result['machine']['date']}.",
            "",
            table(
                [
                    {
                        "path": "restore (read file, decode, rebuild cache, first token)",
                        "median s": med_restore,
                        "runs s": ", ".join(f"{x:.2f}" for x in restore),
                    },
                    {
                        "path": "recompute (prefill context + first token)",
                        "median s": med_recompute,
                        "runs s": ", ".join(f"{x:.2f}" for x in recompute),
                    },
                ],
                ["path", "median s", "runs s"],
            ),
            "",
            f"**Speed-up {result['speedup']:.1f}x.** `{result['command']}`",
        ]
    )
    details = "\n".join(
        [
            md.replace(f" `{result['command']}`", ""),
            "",
            f"Restore stages (fastest run): {stage_txt}. First-token argmax equal to the recomputed one: {same_top1}.",
            "",
            f"Sizes at {args.ratio:g}x: bf16 KV {info['original_bytes'] / 1e6:.2f} MB -> blob {len(blob) / 1e6:.2f} MB; "
            f"codec ratio {info['codec_ratio']:.2f}x over the {info['middle_tokens']} coded tokens (all headers counted), "
            f"whole-cache ratio {info['whole_cache_ratio']:.2f}x (4 sinks + 128-token window stored bf16). "
            f"Encode {encode_s:.2f} s.",
            "",
            f"`{result['command']}`",
        ]
    )
    update_section("ttft_cpu", md, details=details)
    print(details)


if __name__ == "__main__":
    main()
