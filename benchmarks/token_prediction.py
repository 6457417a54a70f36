"""Headroom of coding each token's K/V as the residual of a prediction from the token ids the decoder knows.

A reused prefix is found by its token ids, so whoever restores a cache knows them. A token's pre-RoPE keys and
values at every layer depend, in large part, on the token itself and the few before it (layer 0 wholly: its K/V
are a function of the token alone); a linear map from the input embeddings of tokens ``t``, ``t-1`` and ``t-2``
(ridge regression, fitted on windows of the calibration corpus) predicts part of every layer's K and V, and only
the rest would need coding.

Two measurements, on text the eval does not read (Wikipedia windows, seed 23; windows of the speeches from 2000
on, seed 11), the map fitted on ``--fit-windows`` windows of 2,048 tokens of the calibration corpus (seed 5):

1. Gaussian theory: the relative distortion of reverse water-filling at 16x / 32x / 64x over the PCA of the rows
   and over the PCA of the residuals (basis and allocation from the fitting rows, distortion on 3 held-out
   Wikipedia windows), per kind of layer.
2. The codec with its rate ladder: the K/V coded as shipped (the default calibration) against the residuals coded
   under a calibration of the residuals (``--calibrate``: the default recipe on the same corpus, each calibration
   window's K/V less the map's prediction; without it, the rows' calibration, whose plans do not fit the
   residuals). The prediction's mean over the fitting rows is left in the residuals, so they centre where the
   rows do. The ladder ranks tokens by the attention of the exact keys either way. Next-token KL over 256
   continuation tokens after a 2,048-token context (4 sinks and the 128 newest exact), and the stored ratio as
   ``kvtc eval`` counts it (every byte of the blob but the exact tokens', against 16-bit K/V of the middle
   tokens each layer holds). The token ids are not in the blob (the decoder is assumed to know them).

Writes benchmarks/results/NAME.json. Usage: ``python benchmarks/token_prediction.py --calibrate [--windows 6]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import torch

import _heldout
from kvtc import assets
from kvtc.calibration import load_calibration
from kvtc.codec import Codec
from kvtc.codec.codec import Codec as _Codec
from kvtc.eval.methods import reference_bytes
from kvtc.integrations.hf import extract_slice
from kvtc.layout import KVSlice


def features(emb: torch.Tensor, ids: torch.Tensor, lags: int) -> torch.Tensor:
    """``[T, lags·E]``: the input embeddings of each token and the ``lags - 1`` before it (zeros before the
    first)."""
    e = emb[ids].double()
    out = [e]
    for j in range(1, lags):
        out.append(torch.cat([torch.zeros_like(e[:j]), e[:-j]]))
    return torch.cat(out, 1)


class Predictor:
    """A ridge map from standardised token features to a slice's flattened keys and values."""

    def __init__(self, x: torch.Tensor, ys: dict[str, torch.Tensor], ridge: float = 0.1) -> None:
        self.mu, self.sd = x.mean(0), x.std(0).clamp_min(1e-6)
        a = self.design(x)
        g = a.T @ a
        g += ridge * g.diag().mean() * torch.eye(g.shape[0], dtype=g.dtype)
        self.w = {k: torch.linalg.solve(g, a.T @ y) for k, y in ys.items()}
        # the residual keeps the rows' mean (the calibration's PCA centres on it): subtract the prediction's
        # deviation from its mean over the fitting rows only
        for k in self.w:
            self.w[k][-1] -= (a @ self.w[k]).mean(0)

    def design(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([(x - self.mu) / self.sd, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)

    def __call__(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return self.design(x) @ self.w[kind]


def distortion(fit: torch.Tensor, test: torch.Tensor, bits: float) -> float:
    """Held-out distortion per row: basis and bits from ``fit`` (reverse water-filling), each component's share of
    ``test``'s variance kept as the fitting rows' is."""
    m = fit.mean(0)
    ev, u = torch.linalg.eigh(((fit - m).T @ (fit - m)) / fit.shape[0])
    rates = _heldout.water_rates(ev.clamp_min(1e-14), bits)
    var = ((test - m) @ u).square().mean(0)
    return float((torch.exp2(-2 * rates) * var).sum())


def rows(
    model: Any, emb: torch.Tensor, windows: torch.Tensor, lags: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token features and flattened K / V of every token of ``windows`` past the first 8 (a config-less cache:
    every layer keeps every token)."""
    from transformers import DynamicCache

    xs, ys = [], {"keys": [], "values": []}
    for ids in windows:
        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=ids[None], past_key_values=cache, use_cache=True)
        kv = extract_slice(cache, model, every_token=True)
        xs.append(features(emb, ids, lags)[8:])
        ys["keys"].append(kv.keys[0, 8:].double().flatten(1))
        ys["values"].append(kv.values[0, 8:].double().flatten(1))
    return torch.cat(xs), {k: torch.cat(v) for k, v in ys.items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="token_prediction")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--fit-windows", type=int, default=8)
    ap.add_argument("--lags", type=int, default=3)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--plain", default="48,64", help="targets coding the K/V as shipped")
    ap.add_argument("--residual", default="32,48,64", help="targets coding the residuals")
    ap.add_argument("--name", default="token_prediction")
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="also calibrate on the residuals (the default recipe; cached in the calibrations folder) and code them so",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    model, tok = assets.load_model(args.model, dtype=torch.float32)
    emb = model.get_input_embeddings().weight.detach().float()
    cal = load_calibration("default", model=args.model, progress=False)

    # -------------------------------------------------------------- fit the map on the calibration corpus
    corpus = assets.corpus(cal.corpus.get("name", "sotu-pre2000"))
    x, y = rows(model, emb, assets.token_windows(tok, corpus, 2048, args.fit_windows, seed=5), args.lags)
    pred = Predictor(x, y)
    print(f"fitted on {x.shape[0]} rows ({time.perf_counter() - t0:.0f} s)", flush=True)

    lay = cal.layout
    per = len(lay.heads) * lay.head_dim
    kinds_of_layer = {
        "full": [i for i in range(len(lay.layers)) if not lay.limit(i)],
        "sliding": [i for i in range(len(lay.layers)) if lay.limit(i)],
    }
    theory: dict[str, Any] = {}
    tx_, ty = rows(model, emb, assets.token_windows(tok, assets.corpus("wikipedia"), 2048, 3, seed=23), args.lags)
    for kind in ("keys", "values"):
        yt = ty[kind]
        rf, rt = y[kind] - pred(x, kind), yt - pred(tx_, kind)
        for name, layers in kinds_of_layer.items():
            if not layers:
                continue
            c = torch.cat([torch.arange(i * per, (i + 1) * per) for i in layers])
            total = float((yt[:, c] - y[kind][:, c].mean(0)).square().sum(1).mean())
            for cr in (16, 32, 64):
                bits = 16 * c.numel() / cr
                d0 = distortion(y[kind][:, c], yt[:, c], bits) / total
                d1 = distortion(rf[:, c], rt[:, c], bits) / total
                theory[f"{kind} {name} {cr}x"] = {"rows": d0, "residuals": d1}
                print(f"theory {kind} {name} {cr}x: {d0:.4f} -> {d1:.4f} ({(d1 / d0 - 1) * 100:+.0f}%)", flush=True)

    # -------------------------------------------------------------- a calibration of the residuals
    rcal = cal
    if args.calibrate:
        import kvtc.integrations.hf_calibrate as hc
        from kvtc.calibration.recipe import Recipe

        path = assets.cache_dir() / "calibrations" / f"{args.model}-sotu-pre2000-residuals-{args.lags}.safetensors"
        if path.is_file():
            rcal = load_calibration(path, progress=False)
        else:
            last: dict[str, torch.Tensor] = {}
            corpus_windows, extract = hc.corpus_windows, hc.extract_slice

            def windows(*a: Any, **k: Any) -> Any:
                for ids in corpus_windows(*a, **k):
                    last["ids"] = ids
                    yield ids

            def extract_residual(cache: Any, model_: Any, *a: Any, every_token: bool = False, **k: Any) -> KVSlice:
                kv = extract(cache, model_, *a, every_token=every_token, **k)
                if not every_token:  # the sensitivity pass: the model's own K/V
                    return kv
                f = features(emb, last["ids"], args.lags)
                p = {n: pred(f, n).reshape(kv.keys.shape).to(kv.keys.dtype) for n in ("keys", "values")}
                return dataclasses.replace(kv, keys=kv.keys - p["keys"], values=kv.values - p["values"])

            hc.corpus_windows, hc.extract_slice = windows, extract_residual
            try:
                t1 = time.perf_counter()
                rcal = hc.calibrate_model(
                    model,
                    tok,
                    assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR),
                    Recipe(token_map="off"),  # r14: this study applies its own map
                    model_id=cal.model_id,
                    corpus={"name": "sotu-pre2000", "residuals": f"token embeddings, {args.lags} lags"},
                    progress=False,
                )
                print(f"calibrated on residuals in {time.perf_counter() - t1:.0f} s", flush=True)
            finally:
                hc.corpus_windows, hc.extract_slice = corpus_windows, extract
            rcal.save(path)

    # -------------------------------------------------------------- the codec on residuals
    state: dict[str, Any] = {}
    original_mass = _Codec._attention_mass

    def mass(self: _Codec, kv: KVSlice) -> torch.Tensor:
        return original_mass(self, state.get("exact", kv))

    kls: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    with _heldout.patched(_Codec, _attention_mass=mass):
        for w in _heldout.windows(model, tok, args.windows):
            kv, T = w.kv, w.context.numel()
            f = features(emb, w.context, args.lags)
            held = torch.zeros(T, len(lay.layers), dtype=torch.bool)
            for i in range(len(lay.layers)):
                held[T - lay.held(i, T) :, i] = True
            mask = held[None, :, :, None, None]
            p = {k: (pred(f, k).reshape(kv.keys.shape).float() * mask) for k in ("keys", "values")}
            resid = dataclasses.replace(kv, keys=kv.keys - p["keys"], values=kv.values - p["values"])
            ref = reference_bytes(kv, 4, T - 128)
            state["exact"] = kv
            for label, src, targets, c in (("rows", kv, args.plain, cal), ("residuals", resid, args.residual, rcal)):
                for r in (float(t) for t in targets.split(",")):
                    codec = Codec(c, r, sinks=4, window=128)
                    blob = codec.encode(src)
                    out = codec.decode(blob)
                    if label == "residuals":
                        out = dataclasses.replace(
                            out,
                            keys=out.keys + p["keys"].to(out.keys.dtype),
                            values=out.values + p["values"].to(out.values.dtype),
                        )
                    rel = [
                        float((o.float() - e.float()).norm() / e.float().norm())
                        for o, e in ((out.keys, kv.keys), (out.values, kv.values))
                    ]
                    key = f"{w.text} {label} {r:g}x"
                    kls.setdefault(key, []).append(_heldout.kl(model, w, out))
                    ratios.setdefault(key, []).append(ref / Codec.inspect(blob)["coded_bytes"])
                    print(key, f"KL {kls[key][-1]:.5f} ratio {ratios[key][-1]:.2f} rel K {rel[0]:.3f} V {rel[1]:.3f}")
    _heldout.write(
        args.name,
        t0,
        kls,
        calibration=cal.fingerprint,
        theory=theory,
        ratio={key: sum(x) / len(x) for key, x in ratios.items()},
        ratio_windows=ratios,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
