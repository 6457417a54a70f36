"""The decoding allowance on the embedded models' default calibrations (docs/FORMAT.md, "Decoding allowance"):

* the largest expansion a legitimate blob can have (decoded KV bytes over blob bytes): for each plan, the decoded
  KV bytes of a token over the fewest bytes its sections can hold for it (its plan's raw bytes per token, with
  positions and token ids, divided by ``MAX_CODER_GAIN``), times the layout's densest allocation (every layer is
  decoded for every token, a sliding-window layer's are zeros);
* how far real KV is from the allowance: the sections' raw over coded bytes of real blobs (held-out windows,
  every encode mode the defaults use), which must stay below ``MAX_CODER_GAIN`` with room to spare, and whether
  any needed a pad.

    python benchmarks/decode_allowance.py [--models smollm2,gemma3] [--real-models smollm2] [--windows 4]

Writes benchmarks/results/decode_allowance.json and the "decode_allowance" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, machine, table, update_section, write_json  # noqa: E402
from kvtc import assets  # noqa: E402
from kvtc.calibration import Calibration  # noqa: E402
from kvtc.codec import Codec, budget, container  # noqa: E402
from kvtc.codec.header import PAD_SECTION  # noqa: E402
from kvtc.coding.quantizer import plan_layouts  # noqa: E402
from kvtc.integrations.hf import extract_slice  # noqa: E402
from kvtc.integrations.hf_calibrate import default_calibration  # noqa: E402
from kvtc.layout import MAX_TOKENS  # noqa: E402

TOKENS = 4096  # the slice length the expansion bound is stated at (longer: the same within 1%)


def expansion_bound(cal: Calibration, tokens: int = TOKENS) -> dict[str, float]:
    """Per plan: decoded KV bytes of a ``tokens``-token slice over the fewest bytes a blob of it can have."""
    lay = cal.layout
    esize = 2 if lay.dtype in ("bfloat16", "float16") else 4
    per_layer_token = 2 * len(lay.heads) * lay.head_dim * esize
    dense = tokens * len(lay.layers) * per_layer_token
    held = sum(lay.held(i, tokens) for i in range(len(lay.layers))) * per_layer_token
    ids = 4 * tokens if cal.token_map is not None else 0
    out = {}
    for r in sorted(cal.plans, key=float):
        coded = sum(
            sum(pl.section_sizes("x", tokens, "bits").values())
            for kind in ("keys", "values")
            for pl in plan_layouts(cal, r)[kind]
        )
        raw = coded * held / (tokens * len(lay.layers) * per_layer_token) + 8 * tokens + ids
        out[r] = round(budget.MAX_CODER_GAIN * dense / raw, 1)
    return out


def measured(model: str, cal_path: Path, n_windows: int) -> list[dict]:
    import torch

    cal = Calibration.load(cal_path)
    lm, tok = assets.load_model(model)
    emb = lm.get_input_embeddings().weight.detach() if cal.token_map is not None else None
    rows = []
    ids_all = assets.token_windows(tok, assets.sotu_texts(since=assets.SOTU_SPLIT_YEAR), 2048, n_windows, seed=7)
    codecs = {"identity": Codec.identity()}
    for r in ("8", "16", "32", "64"):
        if r in cal.plans or any(float(k) > float(r) for k in cal.plans):
            codecs[f"{r}x"] = Codec(cal, ratio=float(r), embeddings=emb)
    for w, ids in enumerate(ids_all):
        with torch.no_grad():
            out = lm(ids[None], use_cache=True)
        kv = extract_slice(out.past_key_values, lm)
        kv.token_ids = ids[None]
        for name, codec in codecs.items():
            blob = codec.encode(kv)
            h, _ = container.read_header(blob)
            raw, coded = sum(s.raw for s in h.sections), sum(s.coded for s in h.sections)
            rows.append(
                {
                    "model": model,
                    "window": w,
                    "mode": name,
                    "version": h.version,
                    "raw_over_coded": round(raw / coded, 3),
                    "padded": h.sections[-1].name == PAD_SECTION,
                    "expansion": round(budget.decoded_output_bytes(h) / len(blob), 1),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--no-benchmarks-md", action="store_true")
    ap.add_argument("--real-models", default=None, help="models whose real blobs are measured (default: --models)")
    args = ap.parse_args()
    t0 = time.time()
    bounds, longest, rows = {}, {}, []
    for model in args.models.split(","):
        path = default_calibration(model=model)
        cal = Calibration.load(path)
        bounds[model] = expansion_bound(cal)
        longest[model] = max(expansion_bound(cal, MAX_TOKENS).values())
        if model in (args.real_models or args.models).split(","):
            rows += measured(model, path, args.windows)
    summary = []
    for model in bounds:
        for mode in dict.fromkeys(r["mode"] for r in rows if r["model"] == model):
            sel = [r for r in rows if r["model"] == model and r["mode"] == mode]
            summary.append(
                {
                    "model": model,
                    "mode": mode,
                    "version": sel[0]["version"],
                    "max raw/coded": max(r["raw_over_coded"] for r in sel),
                    "padded": sum(r["padded"] for r in sel),
                    "max expansion": max(r["expansion"] for r in sel),
                }
            )
    worst = {m: max(b.values()) for m, b in bounds.items()}
    result = {
        "machine": machine(),
        "command": command(),
        "date": time.strftime("%Y-%m-%d"),
        "max_coder_gain": budget.MAX_CODER_GAIN,
        "bound_by_plan": bounds,
        "worst_bound": worst,
        "worst_bound_at_max_tokens": longest,
        "windows": rows,
        "seconds": round(time.time() - t0, 1),
    }
    write_json("decode_allowance", result)
    md = (
        "### Decoding allowance (what a blob may cost to decode)\n\n"
        f"`{result['command']}` on {result['machine']['cpu']}, {result['date']}. Allowance: raw bytes of a blob's "
        f"sections ≤ {budget.MAX_CODER_GAIN}× their coded bytes. Largest legitimate expansion (decoded KV bytes per "
        f"blob byte, {TOKENS}-token slices, the plan whose bits per token are fewest): "
        + ", ".join(
            f"{m} {v:.0f}× (plan {max(bounds[m], key=bounds[m].get)}×; {longest[m]:.0f}× at the longest slice a header "
            "may declare, where sliding-window layers hold the least of it)"
            for m, v in worst.items()
        )
        + f". Real blobs ({args.windows} held-out windows of 2,048 tokens per model)"
    )
    full = md + ":\n\n" + table(summary, ["model", "mode", "version", "max raw/coded", "padded", "max expansion"])
    most = max(r["max raw/coded"] for r in summary)
    padded = sum(r["padded"] for r in summary)
    md += f": raw/coded at most {most} in every mode, {padded or 'none'} padded."
    print(full)
    if not args.no_benchmarks_md:
        update_section("decode_allowance", md, details=full)


if __name__ == "__main__":
    main()
