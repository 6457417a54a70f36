"""Which symbol packing compresses better before each entropy coder, measured on real SmolLM2 KV.

    python benchmarks/packing.py [--calibration FILE] [--windows 2] [--tokens 2048]

For each target ratio and each coder (zstd, zlib, raw), encodes the same held-out Wikipedia contexts with
one-symbol-per-byte planes and with bit-packed planes, and reports the coded bytes of the symbol planes and
the codec ratio (middle tokens, all metadata counted). Writes benchmarks/results/packing.json and the
"packing" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, machine, table, update_section, write_json  # noqa: E402
from kvtc import assets  # noqa: E402
from kvtc.calibration import Calibration  # noqa: E402
from kvtc.codec import Codec  # noqa: E402
from kvtc.integrations.hf import extract_slice  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", default=None, help="default: the embedded default calibration")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    if args.calibration is None:
        from kvtc.integrations.hf_calibrate import default_calibration

        args.calibration = str(default_calibration())
    cal = Calibration.load(args.calibration)
    model, tok = assets.load_model()
    ids = assets.token_windows(tok, assets.wikipedia_texts(), args.tokens, args.windows, seed=0)
    slices = []
    for row in ids:
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=row[None], past_key_values=cache, use_cache=True)
        kv = extract_slice(cache, model)
        kv.keys, kv.values = kv.keys.bfloat16(), kv.values.bfloat16()
        kv.layout = type(kv.layout)(**{**kv.layout.to_dict(), "dtype": "bfloat16"})
        slices.append(kv)
    rows = []
    for ratio in cal.ratios:
        for backend in ("zstd", "zlib", "raw"):
            for packing in ("bytes", "bits"):
                codec = Codec(cal, ratio=ratio, backend=backend, packing=packing)
                planes = total = mid = 0.0
                for kv in slices:
                    info = Codec.inspect(codec.encode(kv))
                    planes += sum(
                        s["coded"] for s in info["sections"] if s["name"].split(".")[-1] in ("int2", "int4", "fp8")
                    )
                    total += info["bytes_per_middle_token"] * info["middle_tokens"]
                    mid += info["middle_tokens"]
                orig = 2 * cal.layout.num_features * 2
                rows.append(
                    {
                        "ratio": ratio,
                        "coder": backend,
                        "packing": packing,
                        "plane_bytes": int(planes),
                        "codec_ratio": orig * mid / total,
                    }
                )
    best = {}
    for r in rows:
        key = (r["ratio"], r["coder"])
        if key not in best or r["plane_bytes"] < best[key]["plane_bytes"]:
            best[key] = r
    result = {
        "machine": machine(),
        "command": command(),
        "calibration": cal.hash,
        "rows": rows,
        "windows": args.windows,
        "tokens": args.tokens,
    }
    write_json("packing", result)
    m = result["machine"]
    winners = sorted({(r["coder"], r["packing"]) for r in best.values()})
    md = f"""### Symbol packing before entropy coding (real SmolLM2 KV)

`{result["command"]}` — {m["date"]}, kvtc {m.get("kvtc")} ({m.get("commit", "")}). {args.windows} held-out Wikipedia
contexts of {args.tokens} tokens, calibration `{cal.fingerprint}`. `plane_bytes`: coded bytes of the symbol planes
(all contexts); `codec_ratio`: middle tokens, every header and side-information byte counted.

{table(rows, ["ratio", "coder", "packing", "plane_bytes", "codec_ratio"])}

Smaller planes per (ratio, coder): {", ".join(f"{c}: {p}" for c, p in winners)}.
"""
    update_section("packing", md)
    print(md)


if __name__ == "__main__":
    main()
