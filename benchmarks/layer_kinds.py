"""Where a sliding-window model's loss comes from: next-token KL when only some kinds of layer are coded.

For each held-out window: prefill the model's own cache, code the whole slice at ``--ratio`` (bf16 storage, as
``compress_cache`` stores it), then put back the exact KV everywhere except the layers (and kinds) named by each
variant, and score the next ``--continuation`` tokens against the exact cache. Writes
benchmarks/results/layer_kinds.json. Usage: ``python benchmarks/layer_kinds.py [--model gemma3] [--ratio 16]
[--windows 2]``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys

import torch
from transformers import DynamicCache

import _report
from kvtc import assets
from kvtc.calibration import load_calibration
from kvtc.codec import Codec
from kvtc.integrations.hf import extract_slice, rebuild_cache
from kvtc.layout import KVSlice


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="layer_kinds")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--ratio", type=float, default=16)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=256)
    args = ap.parse_args(argv)
    model, tok = assets.load_model(args.model)
    cal = load_calibration("default", model=args.model, progress=False)
    lay = cal.layout
    full = [i for i in range(len(lay.layers)) if lay.limit(i) == 0]
    sliding = [i for i in range(len(lay.layers)) if lay.limit(i)]
    texts = assets.wikipedia_texts()
    wins = assets.token_windows(tok, texts, args.context + args.continuation + 1, args.windows, seed=0)
    codec = Codec(cal, args.ratio)
    kl: dict[str, list[float]] = {}
    for ids in wins:
        ctx, cont = ids[: args.context], ids[args.context : -1]
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model.get_decoder()(ctx[None], past_key_values=cache)
        kv = extract_slice(cache, model)

        def logp(c: DynamicCache) -> torch.Tensor:
            with torch.inference_mode():
                return torch.log_softmax(model(cont[None], past_key_values=c).logits[0].float(), -1)

        exact = logp(copy.deepcopy(cache))
        stored = KVSlice(dataclasses.replace(kv.layout, dtype="bfloat16"), kv.keys.bfloat16(), kv.values.bfloat16(),
                         kv.positions)  # fmt: skip
        out = codec.decode(codec.encode(stored))
        variants = {
            "all": (full + sliding, ("keys", "values")),
            "full_only": (full, ("keys", "values")),
            "full_keys_only": (full, ("keys",)),
            "full_values_only": (full, ("values",)),
            "sliding_only": (sliding, ("keys", "values")),
        }
        for name, (layers, kinds) in variants.items():
            t = {k: getattr(kv, k).clone() for k in ("keys", "values")}
            for k in kinds:
                t[k][:, :, layers] = getattr(out, k).to(t[k].dtype)[:, :, layers]
            lossy = logp(rebuild_cache(KVSlice(kv.layout, t["keys"], t["values"], kv.positions), model))
            kl.setdefault(name, []).append(float((exact.exp() * (exact - lossy)).sum(-1).mean()))
    result = {
        "command": _report.command(),
        "machine": _report.machine(),
        "ratio": args.ratio,
        "windows": args.windows,
        "kl": {k: sum(v) / len(v) for k, v in kl.items()},
    }
    (_report.RESULTS / "layer_kinds.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["kl"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
