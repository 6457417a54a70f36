"""The held-out protocol of the codec studies: windows of text the eval does not read, each window's exact cache,
and the next-token KL of a lossy one (``kvtc eval``'s storage round trip: a 2,048-token context, 256 scored
continuation tokens), plus reverse water-filling for the studies' Gaussian theory."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import _report
from kvtc import assets
from kvtc.eval.protocols import _logp, _prefill
from kvtc.integrations.hf import extract_slice, rebuild_cache
from kvtc.layout import KVSlice

CONTEXT, CONTINUATION = 2048, 256
#: the held-out texts and their window seeds: Wikipedia (``count`` windows), the speeches from 2000 on (2/3 of them)
SETS = (("wikipedia", 23), ("sotu-2000on", 11))


@dataclass
class Window:
    """One held-out window: its text's name, context and continuation ids, the model's cache after the context,
    that cache as a slice, and the exact next-token log-probabilities of the continuation."""

    text: str
    context: torch.Tensor
    continuation: torch.Tensor
    cache: Any
    kv: KVSlice
    exact: torch.Tensor


def windows(model: Any, tokenizer: Any, count: int) -> Iterator[Window]:
    """``count`` Wikipedia windows (seed 23), then ``max(1, 2·count // 3)`` of the speeches from 2000 on (seed 11);
    none for ``count <= 0``."""
    if count <= 0:
        return
    for text, seed in SETS:
        n = count if text == "wikipedia" else max(1, count * 2 // 3)
        for ids in assets.token_windows(tokenizer, assets.corpus(text), CONTEXT + CONTINUATION + 1, n, seed=seed):
            ctx, cont = ids[:CONTEXT], ids[CONTEXT:-1]
            cache = _prefill(model, ctx)
            kv = extract_slice(cache, model)
            yield Window(text, ctx, cont, cache, kv, _logp(model, cont, cache))


def kl(model: Any, window: Window, out: KVSlice) -> float:
    """KL(exact ‖ lossy) of the continuation's next tokens, averaged, with ``out`` restored as the cache."""
    lossy = _logp(model, window.continuation, rebuild_cache(out, model))
    return float((window.exact.exp() * (window.exact - lossy)).sum(-1).mean())


def ladder_sweep(
    model_name: str, count: int, variants: list[Any], ratios: list[float], select: Any, errors: Any, weights: Any
) -> tuple[dict[str, list[float]], Any]:
    """``(KL per key and window, calibration)``: the default calibration's codec round trip (4 sinks, the 128 newest
    exact) on each held-out window (:func:`windows`) of the model ``model_name`` loaded in float32, for each variant
    (``select(variant)`` puts it in place and returns its label) and each target ratio, with the rate ladder's
    ``kvtc.codec.ladder.errors`` and ``kvtc.codec.tiers.ladder_weights`` replaced by ``errors`` and ``weights``."""
    import kvtc.codec.ladder as ladder
    import kvtc.codec.tiers as tiers
    from kvtc.calibration import load_calibration
    from kvtc.codec import Codec

    model, tok = assets.load_model(model_name, dtype=torch.float32)
    cal = load_calibration("default", model=model_name, progress=False)
    kls: dict[str, list[float]] = {}
    with patched(ladder, errors=errors), patched(tiers, ladder_weights=weights):
        for w in windows(model, tok, count):
            for v in variants:
                label = select(v)
                for r in ratios:
                    emb = model.get_input_embeddings().weight  # for a calibration with a token map
                    codec = Codec(cal, r, sinks=4, window=128, embeddings=emb)
                    key = f"{w.text} {label} {r:g}x"
                    blob = codec.encode(w.kv, token_ids=w.context[None])
                    kls.setdefault(key, []).append(kl(model, w, codec.decode(blob)))
                    print(key, f"{kls[key][-1]:.5f}", flush=True)
    return kls, cal


@contextmanager
def patched(owner: Any, **attrs: Any) -> Iterator[None]:
    """``owner``'s attributes replaced by ``attrs`` for the block, then put back."""
    old = {name: getattr(owner, name) for name in attrs}
    for name, value in attrs.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(owner, name, value)


def water_rates(lam: torch.Tensor, bits: float) -> torch.Tensor:
    """Bits of each component of variances ``lam`` under reverse water-filling at ``bits`` in all."""
    lo, hi = 1e-14, float(lam.max())
    for _ in range(200):
        theta = math.sqrt(lo * hi)
        if float((0.5 * torch.log2(lam / theta)).clamp_min(0).sum()) > bits:
            lo = theta
        else:
            hi = theta
    return (0.5 * torch.log2(lam / hi)).clamp_min(0)


def write(name: str, started: float, kls: dict[str, list[float]], **extra: Any) -> dict[str, Any]:
    """Write benchmarks/results/NAME.json (machine, command, seconds since ``started``, each key's mean KL and its
    windows', and ``extra``), print the means, and return the result."""
    result = {
        "machine": _report.machine(),
        "command": _report.command(),
        "seconds": time.perf_counter() - started,
        **extra,
        "kl": {key: sum(x) / len(x) for key, x in kls.items()},
        "kl_windows": kls,
    }
    _report.write_json(name, result)
    for key, val in result["kl"].items():
        print(f"{key}: {val:.5f}")
    return result
