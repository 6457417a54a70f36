"""Which queries should rank tokens for the rate ladder: those predicted from the newest keys (the default), the
model's own queries at those positions (what an encoder that ran the prefill could see), or queries predicted from
each token's key *and* value (a ridge regression fitted here on the pre-2000 speeches).

Each variant replaces :func:`kvtc.codec.attention.attention_mass` for the default calibration's codec, which then
codes held-out windows as ``kvtc eval``'s storage round trip does (4 sinks, the 128 newest exact); the score is
next-token KL over the 256 continuation tokens. Variants: ``pred`` (default), ``true`` (the model's queries at the
same 32 of the newest 128 positions), ``true128`` (all 128), ``kv`` ([key, value] regression, 32 positions).

Writes benchmarks/results/query_sources.json. Usage: ``python benchmarks/query_sources.py [--windows 6]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

import _report
import kvtc.codec.attention as attention
from kv_joint import capturing
from kvtc import assets
from kvtc.calibration import load_calibration
from kvtc.codec import Codec
from kvtc.eval.protocols import _logp
from kvtc.integrations.hf import describe_model, extract_slice, rebuild_cache

VARIANTS = ("pred", "true", "true128", "kv")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="query_sources")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--ratios", default="16,64")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model, tok = assets.load_model(args.model, dtype=torch.float32)
    layout, rope = describe_model(model)
    cal = load_calibration("default", model=args.model, progress=False)
    L = len(layout.layers)
    ratios = [float(r) for r in args.ratios.split(",")]
    state: dict[str, Any] = {}

    def prefill(ids: torch.Tensor):
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        with capturing(model, queries=True) as seen, torch.inference_mode():
            model(input_ids=ids[None], past_key_values=cache, use_cache=True)
        pos = torch.arange(ids.numel())[None]
        q, k, v = [], [], []
        for layer in layout.layers:
            qq, kk, vv = seen[layer]  # [1, H, T, D]
            q.append(rope.invert(qq.transpose(1, 2)[:, :, None], pos, [layer])[:, :, 0])
            k.append(rope.invert(kk.transpose(1, 2)[:, :, None], pos, [layer])[:, :, 0])
            v.append(vv.transpose(1, 2))
        return cache, torch.stack(q, 2), torch.stack(k, 2), torch.stack(v, 2)  # [1, T, L, H, D]

    original = attention.attention_mass

    def mass(keys, positions, lay, queries, scales, rope_, query_map=None, moment=1):
        if state["mode"] == "pred":
            return original(keys, positions, lay, queries, scales, rope_, query_map, moment)
        B, T, _, H, D = keys.shape
        recent = min(attention.RECENT, T)
        n = recent if state["mode"] == "true128" else attention.QUERY_POSITIONS
        q_idx = torch.linspace(T - recent, T - 1, min(n, recent)).round().long().unique()
        q = state[state["mode"]][:, q_idx]
        G = q.shape[3] // H
        k = rope_.apply(keys.float(), positions, list(lay.layers))
        qpos = positions[:, q_idx]
        q = rope_.apply(q.contiguous(), qpos, list(lay.layers))
        diff = qpos[:, :, None] - positions[:, None, :]
        out = torch.zeros((B, L, T))
        for i in range(L):
            first = T - lay.held(i, T)
            logits = torch.einsum("bqhgd,bnhd->bhgqn", q[:, :, i].reshape(B, -1, H, G, D), k[:, first:, i])
            d = diff[:, :, first:]
            m = d < 0
            if lay.limit(i):
                m |= d >= lay.limit(i)
            logits = (logits * float(scales[i])).masked_fill(m[:, None, None], float("-inf"))
            p = torch.nan_to_num(logits.softmax(-1))
            out[:, i, first:] = (p if moment == 1 else p**moment).sum((1, 2, 3))
        return out

    attention.attention_mass = mass
    # the [key, value] -> query regression, fitted on 6 windows of the pre-2000 speeches
    gram: dict[int, torch.Tensor] = {}
    cross: dict[int, torch.Tensor] = {}
    for ids in assets.token_windows(tok, assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR), 2048, 6, seed=5):
        _, q, k, v = prefill(ids)
        for i in range(L):
            x = torch.cat([k[0, 4:, i].flatten(1), v[0, 4:, i].flatten(1), torch.ones(k.shape[1] - 4, 1)], -1).double()
            y = q[0, 4:, i].reshape(x.shape[0], -1).double()
            gram[i] = gram.get(i, 0) + x.T @ x
            cross[i] = cross.get(i, 0) + x.T @ y
    maps = []
    for i in range(L):
        eye = torch.eye(gram[i].shape[0], dtype=torch.float64)
        eye[-1, -1] = 0
        maps.append(torch.linalg.solve(gram[i] + 1e-2 * gram[i].diagonal()[:-1].mean() * eye, cross[i]).float())
    kl: dict[str, list[float]] = {}
    sets = (("wikipedia", 23, args.windows), ("sotu-2000on", 11, max(1, args.windows * 2 // 3)))
    for text, seed, n in sets:
        for ids in assets.token_windows(tok, assets.corpus(text), 2048 + 256 + 1, n, seed=seed):
            ctx, cont = ids[:2048], ids[2048:-1]
            cache, q, k, v = prefill(ctx)
            kv = extract_slice(cache, model)
            x = torch.cat([k[0].flatten(2), v[0].flatten(2)], -1)  # [T, L, 2HD]
            pred = torch.stack([x[:, i] @ maps[i][:-1] + maps[i][-1] for i in range(L)], 1)
            state["true"] = state["true128"] = q
            state["kv"] = pred.reshape(1, pred.shape[0], L, -1, k.shape[-1])
            exact = _logp(model, cont, cache)
            for mode in VARIANTS:
                state["mode"] = mode
                for r in ratios:
                    codec = Codec(cal, r, sinks=4, window=128)
                    out = codec.decode(codec.encode(kv))
                    lossy = _logp(model, cont, rebuild_cache(out, model))
                    kl.setdefault(f"{text} {mode} {r:g}x", []).append(
                        float((exact.exp() * (exact - lossy)).sum(-1).mean())
                    )
    attention.attention_mass = original
    result = {
        "machine": _report.machine(),
        "command": _report.command(),
        "seconds": time.perf_counter() - t0,
        "kl": {key: sum(x) / len(x) for key, x in kl.items()},
        "kl_windows": kl,
    }
    _report.write_json("query_sources", result)
    for key, val in result["kl"].items():
        print(f"{key}: {val:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
