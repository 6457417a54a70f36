"""Headroom study: one PCA over a token's keys *and* values against kvtc's separate key and value PCAs.

A token's pre-RoPE key and its value are both projections of the same normalised hidden state (Gemma-3-270M: a
640-wide state gives a 256-wide key and a 256-wide value per layer, and the layers of one residual stream are
correlated), so a basis fitted over ``[keys, values]`` of a PCA group can compact more energy into fewer
components than the two bases kvtc fits today. This script measures how much, outside the codec:

1. **Gaussian theory, out of sample.** Both transforms are fitted on ``--fit-windows`` windows of the pre-2000
   speeches (keys and values of each kind of layer scaled to unit energy per token, the ladder's units); reverse
   water-filling on the fitted eigenvalues sets each component's rate for a budget of ``16·p/ratio`` bits per
   token, and the distortion is read on the held-out windows' own variances along the fitted components.
2. **Next-token KL.** The middle tokens of held-out windows (``kvtc eval``'s storage round trip: 4 sinks and the
   128 newest exact, sliding layers only the tokens they hold) are coded in either basis by one uniform scalar
   quantizer (one step for every component of every group; components that never leave zero cost nothing) and
   counted at the empirical entropy of their symbols, the step bisected to the ratio; no ladder, no side
   information, the same for both. KL(exact ‖ lossy) over the 256 continuation tokens.

Writes benchmarks/results/kv_joint.json and the ``kv_joint`` section of BENCHMARKS.md. Usage:
``python benchmarks/kv_joint.py [--model gemma3] [--fit-windows 16] [--windows 6] [--seed 23]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import contextmanager
from typing import Any

import torch

import _heldout
import _report
from kvtc import assets
from kvtc.eval.protocols import _logp, _prefill
from kvtc.integrations.hf import describe_model, extract_slice, rebuild_cache
from kvtc.layout import KVSlice

SINKS, RECENT = 4, 128
RATIOS = (16, 32, 64)


@contextmanager
def capturing(model: Any, queries: bool = False):
    """Run ``model`` with an attention function (registered as transformers documents) that keeps each layer's
    keys and values (with ``queries``: queries, keys and values) as the attention receives them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen: dict[int, tuple[torch.Tensor, ...]] = {}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any):
        kv = (key.detach().float(), value.detach().float())
        seen[module.layer_idx] = ((query.detach().float(),) + kv) if queries else kv
        return sdpa(module, query, key, value, mask, **kw)

    AttentionInterface.register("kvtc_kv_capture", attention)
    AttentionMaskInterface.register("kvtc_kv_capture", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    before = model.config._attn_implementation
    model.set_attn_implementation("kvtc_kv_capture")
    try:
        yield seen
    finally:
        model.set_attn_implementation(before)


def collect(model: Any, tok: Any, layout: Any, rope: Any, texts: list[str], n: int, seed: int):
    """Pre-RoPE keys and values ``[rows, layers, H·D]`` of every position past the sinks of ``n`` windows."""
    ks, vs = [], []
    with capturing(model) as seen:
        for ids in assets.token_windows(tok, texts, 2048, n, seed=seed):
            seen.clear()
            with torch.inference_mode():
                model(input_ids=ids[None])
            T = ids.numel()
            pos = torch.arange(T)[None]
            k, v = [], []
            for layer in layout.layers:
                key, val = seen[layer]  # [1, H, T, D]
                key = key.transpose(1, 2)[:, :, None]
                if rope is not None:
                    key = rope.invert(key, pos, [layer])
                k.append(key[0, SINKS:, 0].reshape(T - SINKS, -1))
                v.append(val[0].transpose(0, 1)[SINKS:].reshape(T - SINKS, -1))
            ks.append(torch.stack(k, 1))
            vs.append(torch.stack(v, 1))
    return torch.cat(ks), torch.cat(vs)


def fit(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means, unit-energy scales and the three bases (keys, values, joint) of one PCA group's rows."""
    k, v = k.double(), v.double()
    mk, mv = k.mean(0), v.mean(0)
    sk, sv = (k - mk).square().sum(1).mean().sqrt(), (v - mv).square().sum(1).mean().sqrt()
    kn, vn = (k - mk) / sk, (v - mv) / sv
    x = torch.cat([kn, vn], 1)
    out = {"mk": mk, "mv": mv, "sk": sk, "sv": sv}
    for name, a in (("k", kn), ("v", vn), ("j", x)):
        lam, u = torch.linalg.eigh(a.T @ a / len(a))
        out[f"lam_{name}"], out[f"u_{name}"] = lam.clamp_min(1e-12), u
    return out


def gaussian(g: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor, ratio: float) -> dict[str, float]:
    """Relative distortion of held-out rows, separate and joint bases, at ``ratio`` (theory)."""
    kn = (k.float() - g["mk"]) / g["sk"]
    vn = (v.float() - g["mv"]) / g["sv"]
    energy = float(kn.square().sum(1).mean() + vn.square().sum(1).mean())
    bits = 2 * kn.shape[1] * 16 / ratio
    out = {}
    sep_var = torch.cat([(kn @ g["u_k"]).square().mean(0), (vn @ g["u_v"]).square().mean(0)])
    r = _heldout.water_rates(torch.cat([g["lam_k"], g["lam_v"]]), bits)
    out["separate"] = float((sep_var * torch.pow(2.0, -2 * r)).sum()) / energy
    joint_var = (torch.cat([kn, vn], 1) @ g["u_j"]).square().mean(0)
    r = _heldout.water_rates(g["lam_j"], bits)
    out["joint"] = float((joint_var * torch.pow(2.0, -2 * r)).sum()) / energy
    return out


def entropy_bits(sym: torch.Tensor) -> float:
    """Sum over columns of the empirical entropy of ``sym`` ``[n, c]`` times ``n``."""
    n, c = sym.shape
    sym = sym - sym.min()
    m = int(sym.max()) + 1
    cnt = torch.bincount((sym + torch.arange(c)[None] * m).reshape(-1), minlength=c * m).double()
    return float(-(cnt * torch.log2((cnt / n).clamp_min(1e-300))).sum())


def code(
    kv: KVSlice, groups: dict[str, dict], mode: str, step: float, weights: torch.Tensor | None = None
) -> tuple[KVSlice, float]:
    """The slice with its middle tokens quantized at ``step`` in ``mode``'s basis, and the ratio to bf16; with
    ``weights`` ``[L, T]`` (the ladder's weight of each token's error in each layer), each token's step is ``step``
    over the square root of its weight averaged over the group's layers (one price for the blob)."""
    T = kv.keys.shape[1]
    keys, vals = kv.keys.clone(), kv.values.clone()
    bits = ref = 0.0
    for g in groups.values():
        lay, limit = g["layers"], g["limit"]
        lo, hi = (SINKS if not limit else max(SINKS, T - limit + 1)), T - RECENT
        n = hi - lo
        k = (kv.keys[0, lo:hi, lay].reshape(n, -1).float() - g["mk"]) / g["sk"]
        v = (kv.values[0, lo:hi, lay].reshape(n, -1).float() - g["mv"]) / g["sv"]
        ref += 2 * k.numel() * 16
        st: float | torch.Tensor = step
        if weights is not None:
            st = step / weights[lay, lo:hi].mean(0).clamp_min(1e-8).sqrt()[:, None]
        if mode == "joint":
            s = torch.round(torch.cat([k, v], 1) @ g["u_j"] / st)
            bits += entropy_bits(s.long())
            y = (s * st) @ g["u_j"].T
            kh, vh = y[:, : k.shape[1]], y[:, k.shape[1] :]
        else:
            sk_, sv_ = torch.round(k @ g["u_k"] / st), torch.round(v @ g["u_v"] / st)
            bits += entropy_bits(sk_.long()) + entropy_bits(sv_.long())
            kh, vh = (sk_ * st) @ g["u_k"].T, (sv_ * st) @ g["u_v"].T
        keys[0, lo:hi, lay] = (kh * g["sk"] + g["mk"]).reshape(n, len(lay), *keys.shape[3:]).to(keys)
        vals[0, lo:hi, lay] = (vh * g["sv"] + g["mv"]).reshape(n, len(lay), *vals.shape[3:]).to(vals)
    return KVSlice(kv.layout, keys, vals, kv.positions, kv.model_id), ref / max(bits, 1.0)


def at_ratio(kv: KVSlice, groups: dict, mode: str, ratio: float, weights: torch.Tensor | None = None):
    lo, hi = math.log(1e-3), math.log(50.0)
    for _ in range(16):
        mid = (lo + hi) / 2
        if code(kv, groups, mode, math.exp(mid), weights)[1] < ratio:
            lo = mid
        else:
            hi = mid
    return code(kv, groups, mode, math.exp(hi), weights)


def ladder_weights(kv: KVSlice, cal: Any, rope: Any) -> torch.Tensor:
    """``[L, T]``: the codec's weight of each token's error in each layer (the attention the newest positions'
    predicted queries give it, over the layer's mean, squared; :mod:`kvtc.codec.tiers`), zero where a layer does not
    hold the token."""
    from kvtc.codec.attention import attention_mass
    from kvtc.codec.tiers import LADDER_POWER

    mass = attention_mass(kv.keys, kv.positions, kv.layout, cal.queries, cal.query_scales, rope, cal.query_map)[0]
    held = mass > 0
    mean = (mass.sum(1) / held.sum(1).clamp_min(1))[:, None]
    return (mass / mean.clamp_min(1e-30)) ** LADDER_POWER


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kv_joint")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--fit-windows", type=int, default=16)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--texts", default="wikipedia")
    ap.add_argument("--seed", type=int, default=23, help="held-out windows (kvtc eval reads seed 0)")
    ap.add_argument(
        "--weighted", action="store_true", help="each token's step from the codec's ladder weights (one price)"
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model, tok = assets.load_model(args.model, dtype=torch.float32)
    layout, rope = describe_model(model)
    cal = None
    if args.weighted:
        from kvtc.calibration import load_calibration

        cal = load_calibration("default", model=args.model, progress=False)
    k_fit, v_fit = collect(model, tok, layout, rope, assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR),
                           args.fit_windows, 3)  # fmt: skip
    k_test, v_test = collect(model, tok, layout, rope, assets.corpus(args.texts), args.windows, args.seed)
    groups: dict[str, dict] = {}
    theory: dict[str, dict] = {}
    for limit in sorted({layout.limit(i) or 0 for i in range(len(layout.layers))}):
        name = "sliding" if limit else "full"
        lay = [i for i in range(len(layout.layers)) if (layout.limit(i) or 0) == limit]
        g = fit(k_fit[:, lay].reshape(len(k_fit), -1), v_fit[:, lay].reshape(len(v_fit), -1))
        g = {key: val.float() if val.dim() else val for key, val in g.items()}
        groups[name] = g | {"layers": lay, "limit": limit}
        kt, vt = k_test[:, lay].reshape(len(k_test), -1), v_test[:, lay].reshape(len(v_test), -1)
        theory[name] = {str(r): gaussian(g, kt, vt, r) for r in RATIOS}
    del k_fit, v_fit, k_test, v_test
    kl: dict[str, list[float]] = {}
    stored: dict[str, list[float]] = {}
    for ids in assets.token_windows(tok, assets.corpus(args.texts), 2048 + 256 + 1, args.windows, seed=args.seed):
        ctx, cont = ids[:2048], ids[2048:-1]
        cache = _prefill(model, ctx)
        kv = extract_slice(cache, model)
        exact = _logp(model, cont, cache)
        weights = None if cal is None else ladder_weights(kv, cal, rope)
        for mode in ("separate", "joint"):
            for r in RATIOS:
                out, got = at_ratio(kv, groups, mode, r, weights)
                lossy = _logp(model, cont, rebuild_cache(out, model))
                key = f"{mode} {r}x"
                kl.setdefault(key, []).append(float((exact.exp() * (exact - lossy)).sum(-1).mean()))
                stored.setdefault(key, []).append(got)
        print({key: round(sum(x) / len(x), 5) for key, x in kl.items()}, file=sys.stderr, flush=True)
    result = {
        "machine": _report.machine(),
        "command": _report.command(),
        "seconds": time.perf_counter() - t0,
        "model": args.model,
        "texts": args.texts,
        "windows": args.windows,
        "seed": args.seed,
        "fit_windows": args.fit_windows,
        "weighted": args.weighted,
        "theory": theory,
        "kl": {key: sum(x) / len(x) for key, x in kl.items()},
        "kl_windows": kl,
        "ratio": {key: sum(x) / len(x) for key, x in stored.items()},
    }
    name = f"kv_joint_{args.model}" + ("_weighted" if args.weighted else "")
    _report.write_json(name, result)
    _report.update_section(name, markdown(result))
    print(markdown(result))
    return 0


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"### One PCA over keys and values ({res['model']}): headroom outside the codec"
        + (", tokens weighted as the ladder weighs them" if res.get("weighted") else ""),
        "",
        f"`{res['command']}` — {m['date']} ({res['seconds'] / 60:.0f} min); {m['cpu']}, {m['cores']} cores, torch "
        f"{m['torch']}. Bases fitted on {res['fit_windows']} windows of 2,048 tokens of the pre-2000 speeches; "
        f"{res['windows']} held-out {res['texts']} windows (seed {res['seed']}) of 2,048 + 256 tokens.",
        "",
        "Gaussian theory (relative distortion of the held-out rows, keys and values at unit energy each):",
        "",
        "| layers | ratio | separate K / V PCAs | one K+V PCA | change |",
        "|---|---|---|---|---|",
    ]
    for name, rows in res["theory"].items():
        for r, d in rows.items():
            lines.append(
                f"| {name} | {r}× | {d['separate']:.4f} | {d['joint']:.4f} | {d['joint'] / d['separate'] - 1:+.0%} |"
            )
    lines += [
        "",
        "Next-token KL, one uniform quantizer step"
        + (" over the square root of each token's ladder weight" if res.get("weighted") else "")
        + ", empirical entropy (no rungs, no side information):",
        "",
        "| target | separate: ratio, KL | joint: ratio, KL | change |",
        "|---|---|---|---|",
    ]
    for r in RATIOS:
        s, j = f"separate {r}x", f"joint {r}x"
        lines.append(
            f"| {r}× | {res['ratio'][s]:.2f}×, {res['kl'][s]:.4f} | {res['ratio'][j]:.2f}×, {res['kl'][j]:.4f} | "
            f"{res['kl'][j] / res['kl'][s] - 1:+.0%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
