"""Gemma-3-270M end to end: the model's own ``DynamicCache(config=...)`` (15 sliding-window layers holding their
newest 511 tokens, 3 full-attention layers) stored and restored, losslessly and through a small real calibration."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from kvtc import assets
from kvtc.calibration import Recipe
from kvtc.codec import Codec
from kvtc.integrations.hf import compress_cache, describe_model, restore_cache
from kvtc.integrations.hf_calibrate import calibrate_model

CONTEXT = 2048
GREEDY_TOKENS = 32
#: next-token KL(exact || restored) after the 16x store of the small calibration (measured well below)
KL_BOUND = 0.5
SLIDING = [i for i in range(18) if i % 6 != 5]
FULL = [5, 11, 17]


@pytest.fixture(scope="module")
def prefilled(gemma3_model, wiki_texts):
    """A held-out Wikipedia window of 2,048 tokens (BOS first), prefilled into the model's own cache."""
    model, tok = gemma3_model
    ids = assets.token_windows(tok, wiki_texts, CONTEXT, 1, seed=0)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return ids, cache, out.logits[:, -1].argmax(-1, keepdim=True)


def greedy(model, cache, first: torch.Tensor) -> list[int]:
    tokens, cur = [], first
    with torch.inference_mode():
        for _ in range(GREEDY_TOKENS):
            cur = model(cur, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(cur))
    return tokens


def test_layout_names_the_sliding_layers(gemma3_model):
    model, tok = gemma3_model
    layout, rope = describe_model(model)
    assert layout.max_tokens == tuple(0 if i in FULL else 511 for i in range(18))
    assert [list(sp.indices) for sp in layout.spans] == [SLIDING, FULL]
    assert assets.token_windows(tok, ["Hello world. " * 50], 16, 1)[0, 0] == tok.bos_token_id


def test_lossless_store_holds_only_what_each_layer_holds_and_continues_identically(gemma3_model, prefilled):
    model, _ = gemma3_model
    ids, cache, first = prefilled
    assert ids[0, 0] == model.config.bos_token_id
    assert all(cache.layers[i].keys.shape[2] == 511 for i in SLIDING)
    assert all(cache.layers[i].keys.shape[2] == CONTEXT for i in FULL)
    blob = compress_cache(cache, model, Codec.identity(), dtype=None)  # float32, as the model runs: lossless
    info = Codec.inspect(blob)
    assert info["version"] == 2
    assert [(sp["layers"], sp["held"]) for sp in info["spans"]] == [(SLIDING, 511), (FULL, CONTEXT)]
    # the raw sections hold exactly the cache's own tensors: 511 tokens per sliding layer, 2,048 per full one
    raw = {s["name"]: s["raw"] for s in info["sections"]}
    assert raw["raw.keys"] == sum(cache.layers[i].keys.numel() * 4 for i in range(18))
    assert info["original_bytes"] == 2 * raw["raw.keys"]
    restored = restore_cache(blob, model)
    assert greedy(model, restored, first) == greedy(model, copy.deepcopy(cache), first)


@pytest.fixture(scope="module")
def small_calibration(gemma3_model):
    """A quick real calibration of Gemma-3 (4K tokens of pre-2000 speeches, no sensitivity pass)."""
    model, tok = gemma3_model
    texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
    recipe = Recipe(tokens=4080, ratios=(16,), sensitivity="none", dp_rows=2048)
    return calibrate_model(model, tok, texts, recipe, progress=False)


def test_coded_cache_reconstructs_both_kinds_of_layer(gemma3_model, prefilled, small_calibration):
    model, _ = gemma3_model
    _, cache, first = prefilled
    cal = small_calibration
    assert [c.numel() for c in cal.columns] == [15 * 256, 3 * 256]  # one PCA per kind of layer
    blob = compress_cache(cache, model, calibration=cal, ratio=16)
    info = Codec.inspect(blob)
    assert info["codec_ratio"] > 14  # bf16 bytes of the coded tokens each layer holds / every coded byte
    restored = restore_cache(blob, model, calibration=cal)
    errors = {}
    for group, layers, coded in (("sliding", SLIDING, slice(0, 511 - 128)), ("full", FULL, slice(4, CONTEXT - 128))):
        for kind in ("keys", "values"):
            a = torch.cat([getattr(cache.layers[i], kind)[:, :, coded] for i in layers]).double()
            b = torch.cat([getattr(restored.layers[i], kind)[:, :, coded] for i in layers]).double()
            rel = errors[group, kind] = float((a - b).norm() / a.norm())
            assert rel < 0.5, (group, kind, rel)
            exact_tail = torch.cat([getattr(restored.layers[i], kind)[:, :, -128:] for i in layers])
            want_tail = torch.cat([getattr(cache.layers[i], kind)[:, :, -128:] for i in layers])
            tail = float((exact_tail - want_tail).double().norm() / want_tail.double().norm())
            assert tail < 1e-2, (group, kind, tail)  # the recent window is stored raw (bf16: ~0.3% error)
    with torch.inference_mode():
        exact = torch.log_softmax(model(first, past_key_values=copy.deepcopy(cache)).logits[0, -1].float(), -1)
        lossy = torch.log_softmax(model(first, past_key_values=restored).logits[0, -1].float(), -1)
    kl = float((exact.exp() * (exact - lossy)).sum())
    assert kl < KL_BOUND, (kl, errors)
