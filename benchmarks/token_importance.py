"""Would spending more bits on the tokens attention reads lower Gemma-3-270M's next-token KL at the same bytes?

kvtc spends the same bits on every middle token of a PCA group. Attention is not uniform: a few tokens take most
of a full-attention layer's mass. This study bounds what a token-adaptive rate could give, before anyone builds
it: each PCA group's middle tokens are ranked by an importance score, the top ``f`` are taken from a blob coded
at a high-quality target and the rest from one coded at a low-quality target, and the bytes are counted as
``f · bytes(high) + (1 - f) · bytes(low)`` (each group's bits are spread evenly over its tokens). The pairs are
chosen to store what the plain target stores. Scores:

* ``oracle``: the attention mass each token receives from the continuation's own queries (summed over heads,
  queries and the group's layers), measured on the exact cache: an upper bound, the encoder cannot know it.
* ``recent``: the attention mass each token receives from the queries of the 128 exact newest tokens (their
  own prefill queries): what an encoder that keeps those queries could compute.
* ``predicted``: as ``recent``, but each of those queries predicted from the token's own (exact) key by a
  ridge regression per layer fitted on 4 windows of the calibration corpus: what an encoder that holds only the
  cache and a calibration could compute.
* ``meanq``: as ``recent``, with every query replaced by its head's mean pre-RoPE query over the calibration
  corpus (rotated to each of the newest positions): the least an encoder needs, ``[layers, heads, head_dim]``.
* ``random``: a random ranking (the control: mixing two plans by itself should not help).

Each mix is ``target:high/low`` (``--mixes``), both ratios of the calibration; the share of tokens taken from the
high one follows from ``share/high + (1 - share)/low = 1/target``. As ``kvtc eval``'s storage round trip on
``--windows`` windows of 2,048 + 256 tokens of each held-out text. Writes benchmarks/results/token_importance.json
and the ``token_importance`` section of BENCHMARKS.md.
Usage: ``python benchmarks/token_importance.py [--windows 4] [--texts wikipedia] [--scores meanq random]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

import _report
from kvtc import assets
from kvtc.calibration import load_calibration
from kvtc.eval.methods import KVTC, Result
from kvtc.eval.suite import DEFAULT_CONTEXT, DEFAULT_CONTINUATION
from kvtc.layout import KVSlice

TEXTS = {"sotu-2000on": "speeches from 2000 on", "wikipedia": "Wikipedia"}
RECENT = 128


def attention_mass(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(oracle, recent)``: ``[layers, context]`` attention mass each context token receives from the
    continuation's queries and from the newest ``RECENT`` context tokens' queries (exact cache, heads summed)."""
    seq = ids[: DEFAULT_CONTEXT + DEFAULT_CONTINUATION][None]
    with torch.no_grad():
        att = model(seq, output_attentions=True, use_cache=False).attentions
    oracle = torch.stack([a[0, :, DEFAULT_CONTEXT:, :DEFAULT_CONTEXT].float().sum((0, 1)) for a in att])
    lo = DEFAULT_CONTEXT - RECENT
    recent = torch.stack([a[0, :, lo:DEFAULT_CONTEXT, :DEFAULT_CONTEXT].float().sum((0, 1)) for a in att])
    return oracle, recent


def fit_queries(model: Any, tok: Any, windows: int = 4, ridge: float = 1e-2) -> tuple[list, list]:
    """Per layer: ``A [kv_dim, heads, head_dim]`` predicting each query head's pre-RoPE query from the token's own
    pre-RoPE key (ridge regression on ``windows`` windows of the calibration corpus), and the mean query per head."""
    ids = assets.token_windows(tok, assets.corpus("sotu-pre2000"), DEFAULT_CONTEXT, windows, seed=1)
    layers = model.model.layers
    qs: list[list[torch.Tensor]] = [[] for _ in layers]
    ks: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.self_attn.q_norm.register_forward_hook(lambda m, a, o, i=i: qs[i].append(o[0].float())))
        hooks.append(layer.self_attn.k_norm.register_forward_hook(lambda m, a, o, i=i: ks[i].append(o[0].float())))
    with torch.no_grad():
        for w in range(windows):
            model(ids[w : w + 1], use_cache=False)
    for h in hooks:
        h.remove()
    preds, means, r2 = [], [], []
    for i in range(len(layers)):
        q = torch.cat(qs[i], 1)  # [Hq, T, D]
        k = torch.cat(ks[i], 1)  # [Hkv, T, D]
        x = k.permute(1, 0, 2).reshape(k.shape[1], -1).double()  # [T, Hkv*D]
        y = q.permute(1, 0, 2).reshape(q.shape[1], -1).double()  # [T, Hq*D]
        g = x.T @ x
        a = torch.linalg.solve(g + ridge * g.diagonal().mean() * torch.eye(g.shape[0], dtype=g.dtype), x.T @ y)
        preds.append(a.float().reshape(x.shape[1], q.shape[0], q.shape[2]))
        means.append(q.mean(1))  # [Hq, D]
        r2.append(float(1 - (y - x @ a).pow(2).sum() / (y - y.mean(0)).pow(2).sum()))
    print("query prediction R^2 per layer:", [round(v, 3) for v in r2], flush=True)
    return preds, means


def predicted_mass(kv: KVSlice, rope: Any, preds: list, means: list, windows: list[int], use_mean: bool):
    """``[layers, tokens]``: the attention mass each token receives from the newest ``RECENT`` tokens' queries,
    each predicted from the token's own key (or the mean query), as the model's attention would spread it."""
    n = kv.num_tokens
    pos = kv.positions
    lay = kv.layout
    out = torch.zeros(len(lay.layers), n)
    recent = torch.arange(n - RECENT, n)
    for j, layer in enumerate(lay.layers):
        k = kv.keys[:, :, j : j + 1].float()  # [1, n, 1, Hkv, D] pre-RoPE
        if use_mean:
            q = means[layer][None, None, None].expand(1, RECENT, 1, -1, -1)
        else:
            q = torch.einsum("btlc,chd->btlhd", k[:, recent].flatten(3), preds[layer])
        kr = rope.apply(k, pos, [layer])[0, :, 0]  # [n, Hkv, D]
        qr = rope.apply(q.contiguous(), pos[:, recent], [layer])[0, :, 0]  # [R, Hq, D]
        hkv = kr.shape[1]
        qr = qr.reshape(RECENT, hkv, -1, qr.shape[-1])  # query heads grouped by their kv head
        logits = torch.einsum("rgqd,ngd->gqrn", qr, kr) / qr.shape[-1] ** 0.5
        diff = recent[:, None] - torch.arange(n)[None]
        mask = diff < 0
        if windows[j]:
            mask |= diff >= windows[j]
        logits = logits.masked_fill(mask, float("-inf"))
        out[j] = logits.softmax(-1).sum((0, 1, 2))
    return out


_CODED: dict[float, Result] = {}
_CODED_FOR: list[Any] = [None]


def _coded(kv: KVSlice, ratio: float, cal: Any, start: int, stop: int, rope: Any) -> Result:
    """kvtc's round trip of ``kv`` at ``ratio``, computed once per window (the mixes share them)."""
    if _CODED_FOR[0] is not kv:
        _CODED.clear()
        _CODED_FOR[0] = kv
    if ratio not in _CODED:
        _CODED[ratio] = KVTC(cal, ratio, tiers="none").compress(kv, start, stop, rope)
    return _CODED[ratio]


class _Mix(KVTC):
    """Top ``frac`` of each group's middle tokens by ``score`` from the ``high`` target, the rest from ``low``."""

    def __init__(
        self,
        cal,
        target: float,
        high: float,
        low: float,
        frac: float,
        score: str,
        scores: list,
        queries: tuple = (),
        windows: tuple = (),
    ):
        super().__init__(cal, target, name=f"{score}:{target:g}:{high:g}:{low:g}:{frac:g}",
                         label=f"{score} {target:g}x {high:g}/{low:g} {frac:g}")  # fmt: skip
        self.high, self.low = KVTC(cal, high), KVTC(cal, low)
        self.frac, self.score, self.scores, self.calls = frac, score, scores, 0
        self.queries, self.windows = queries, list(windows)

    def compress(self, kv: KVSlice, start: int, stop: int, rope: Any) -> Result:
        hi = _coded(kv, self.high.ratio, self.calibration, start, stop, rope)
        lo = _coded(kv, self.low.ratio, self.calibration, start, stop, rope)
        oracle, recent = self.scores[self.calls]
        self.calls += 1
        k, v = lo.kv.keys.clone(), lo.kv.values.clone()
        lay = kv.layout
        gen = torch.Generator().manual_seed(self.calls)
        if self.score in ("predicted", "meanq"):
            guess = predicted_mass(kv, rope, *self.queries, self.windows, self.score == "meanq")
        # the groups of a "global" grouping are one per kind of layer: recover each group's layers from the layout
        kinds: dict[int, list[int]] = {}
        for i in range(len(lay.layers)):
            kinds.setdefault(int(lay.max_tokens[i]) if lay.max_tokens else 0, []).append(i)
        for held, layers in kinds.items():
            first = start if held == 0 else max(start, kv.num_tokens - held)
            n = stop - first
            if n <= 0:
                continue
            if self.score == "random":
                s = torch.rand(n, generator=gen)
            elif self.score in ("predicted", "meanq"):
                s = guess[layers][:, first:stop].sum(0)
            else:
                s = (oracle if self.score == "oracle" else recent)[layers][:, first:stop].sum(0)
            top = s.topk(max(1, round(self.frac * n))).indices + first
            for i in layers:
                k[:, top, i], v[:, top, i] = hi.kv.keys[:, top, i], hi.kv.values[:, top, i]
        nbytes = round(self.frac * hi.bytes + (1 - self.frac) * lo.bytes)
        out = KVSlice(kv.layout, k, v, kv.positions, kv.model_id)
        return Result(out, nbytes, bytes_raw=lo.bytes_raw, info=lo.info)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="token_importance")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--texts", nargs="+", default=list(TEXTS))
    ap.add_argument("--mixes", nargs="+", default=["32:16/48", "32:16/64", "16:8/24", "24:12/48"],
                    help="target:high/low, ratios of the calibration")  # fmt: skip
    ap.add_argument("--scores", nargs="+", default=["oracle", "recent", "predicted", "meanq", "random"])
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = assets.load_model("gemma3")
    model.set_attn_implementation("eager")
    cal = load_calibration("default", model="gemma3", progress=False)
    queries = fit_queries(model, tok)
    windows = [int(getattr(layer.self_attn, "sliding_window", None) or 0) for layer in model.model.layers]
    # (target, high, low, frac) storing what the target stores: frac/high + (1 - frac)/low = 1/target
    mixes = []
    for spec in args.mixes:
        t, rest = spec.split(":")
        hi, lo = (float(x) for x in rest.split("/"))
        mixes.append((float(t), hi, lo, (1 / float(t) - 1 / lo) / (1 / hi - 1 / lo)))
    targets = sorted({m[0] for m in mixes})
    rows = []
    for text in args.texts:
        ids = assets.token_windows(
            tok, assets.corpus(text), DEFAULT_CONTEXT + DEFAULT_CONTINUATION + 1, args.windows, seed=0
        )
        scores = [attention_mass(model, ids[w]) for w in range(args.windows)]
        model.set_attn_implementation("sdpa")
        methods: list[Any] = [KVTC(cal, t, name=f"kvtc:{t:g}", tiers="none") for t in targets]
        for t, hi, lo, f in mixes:
            for score in args.scores:
                methods.append(_Mix(cal, t, hi, lo, f, score, scores, queries, windows))
        for txt, m, figures in _report.roundtrip_rows(model, tok, methods, [text], args.windows):
            parts = m.name.split(":")
            t = float(parts[1])
            rows.append({"text": txt, "score": parts[0], "target": t, "high": float(parts[2]) if len(parts) > 2 else t,
                         "low": float(parts[3]) if len(parts) > 2 else t,
                         "frac": float(parts[4]) if len(parts) > 2 else 1.0, **figures})  # fmt: skip
            print(rows[-1], flush=True)
        model.set_attn_implementation("eager")
    result = {
        "name": "token_importance",
        "command": _report.command(),
        "machine": _report.machine(),
        "windows": args.windows,
        "calibration": cal.fingerprint,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _report.publish("token_importance", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        "### Gemma-3-270M: more bits for the tokens attention reads (upper bound)",
        "",
        f"`{result['command']}` — {result['machine']['date']}, {result['seconds'] / 60:.1f} min. The default "
        f"calibration ({result['calibration']}), {result['windows']} windows of 2,048 + 256 tokens of each held-out "
        "text. Each group's top tokens by the score from the high target's blob, the rest from the low target's; "
        "bytes counted as the mix's share of each blob. (Built into the codec since 2026-12-03 with the `meanq` "
        'ranking, recipe r11 and container version 3: "Quality vs bytes on Gemma-3-270M" above.)',
        "",
        "| coded text | target | score | high / low target, share high | ratio | Δppl | KL(exact‖lossy) | top-1 agree "
        "| K rel. err | V rel. err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["rows"], key=lambda r: (r["text"], r["target"], r["score"] != "kvtc")):
        mix = "—" if r["score"] == "kvtc" else f"{r['high']:g}× / {r['low']:g}×, {r['frac']:.1%}"
        lines.append(f"| {TEXTS[r['text']]} | {r['target']:g}× | {r['score']} | {mix} | " + _report.roundtrip_cells(r))
    lines += ["", "Result: `benchmarks/results/token_importance.json`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
