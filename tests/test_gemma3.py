"""Gemma-3-270M end to end: the model's own ``DynamicCache(config=...)`` (15 sliding-window layers holding their
newest 511 tokens, 3 full-attention layers) stored and restored, losslessly and through a small real calibration
that carries a token map (each token's K/V coded less a prediction from its token ids)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from cached_calibrations import cached_calibration
from kvtc import assets
from kvtc.calibration import Recipe
from kvtc.calibration.artifact import Calibration
from kvtc.codec import Codec
from kvtc.errors import CalibrationError, CalibrationMismatch, FormatError
from kvtc.integrations.hf import compress_cache, describe_model, extract_slice, restore_cache

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
    """A quick real calibration of Gemma-3 (4K tokens of pre-2000 speeches, no sensitivity pass) with a token map,
    built once per environment (``cached_calibrations``)."""
    recipe = Recipe(tokens=4080, ratios=(16,), sensitivity="none", dp_rows=2048)
    return Calibration.load(cached_calibration("gemma3", recipe, loaded=gemma3_model))


def test_coded_cache_reconstructs_both_kinds_of_layer(gemma3_model, prefilled, small_calibration):
    model, _ = gemma3_model
    cal = small_calibration
    assert [c.numel() for c in cal.columns] == [15 * 256, 3 * 256]  # one PCA per kind of layer
    ids, cache, first = prefilled
    blob = compress_cache(cache, model, calibration=cal, ratio=16, input_ids=ids)
    info = Codec.inspect(blob)
    assert info["version"] == 5 and cal.token_map is not None
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


def test_token_map_blob_carries_its_ids_and_keeps_raw_tokens_exact(gemma3_model, prefilled, small_calibration):
    model, _ = gemma3_model
    ids, cache, _ = prefilled
    cal = small_calibration
    emb = model.get_input_embeddings().weight
    kv = extract_slice(cache, model)
    codec = Codec(cal, 16, embeddings=emb)
    with pytest.raises(CalibrationError, match="token_ids"):
        codec.encode(kv)
    with pytest.raises(CalibrationError, match="token_ids must be"):
        codec.encode(kv, token_ids=ids[:, :-1])
    with pytest.raises(CalibrationMismatch, match="vocabulary"):
        codec.encode(kv, token_ids=torch.full_like(ids, cal.token_map.vocab))
    blob = codec.encode(kv, token_ids=ids)
    assert [s["name"] for s in Codec.inspect(blob)["sections"]][:2] == ["positions", "tokens"]
    out = codec.decode(blob)
    assert torch.equal(out.token_ids, ids)
    # the raw tokens (4 sinks and 128 newest of the full layers, the 128 newest of the sliding ones) are untouched
    for layers, first in ((FULL, 0), (SLIDING, CONTEXT - 511)):
        for got, want in ((out.keys, kv.keys), (out.values, kv.values)):
            assert torch.equal(got[:, -128:, layers], want[:, -128:, layers])
            if first == 0:
                assert torch.equal(got[:, :4, layers], want[:, :4, layers])
            assert not got[:, :first, layers].any()  # tokens a sliding layer does not hold stay zero
    # layer by layer, the same reconstruction
    for i, (layer, k, v) in enumerate(codec.decode_layers(blob)):
        assert torch.equal(k, out.keys[:, :, i]) and torch.equal(v, out.values[:, :, i]), layer
    # the prediction is what the residuals are coded against: decoded without it, the K/V are far off
    residual = Codec._decode(codec, blob)
    rel = float((residual.values.float() - kv.values.float()).norm() / kv.values.float().norm())
    assert rel > 0.2


def test_token_map_refuses_other_embeddings_and_missing_ones(gemma3_model, prefilled, small_calibration, tmp_path):
    model, _ = gemma3_model
    ids, cache, _ = prefilled
    cal = small_calibration
    emb = model.get_input_embeddings().weight
    with pytest.raises(CalibrationMismatch, match="not the ones"):
        Codec(cal, 16, embeddings=emb.flip(0))
    with pytest.raises(CalibrationMismatch, match="another model"):
        Codec(cal, 16, embeddings=emb[:, :64])
    blob = compress_cache(cache, model, calibration=cal, ratio=16, input_ids=ids)
    with pytest.raises(CalibrationMismatch, match="embeddings"):
        Codec(cal, 16).decode(blob)
    # the map is part of the calibration: saved and loaded with the same hash, refused when edited
    path = cal.save(tmp_path / "cal.safetensors")
    back = Calibration.load(path)
    assert back.hash == cal.hash and back.version == cal.version == 11  # an int8 token map, float16 bases
    assert torch.equal(back.token_map.weights["keys"], cal.token_map.weights["keys"])
    import dataclasses

    edited = dataclasses.replace(cal, token_map=dataclasses.replace(cal.token_map, std=cal.token_map.std * 1.01))
    assert edited.hash != cal.hash  # another map is another calibration: its blobs do not decode with this one
    with pytest.raises(CalibrationMismatch):
        Codec(edited, 16, embeddings=emb).decode(blob)


def test_token_map_blob_refuses_a_version_without_ids(gemma3_model, prefilled, small_calibration):
    import json
    import struct
    import zlib

    model, _ = gemma3_model
    ids, cache, _ = prefilled
    blob = compress_cache(cache, model, calibration=small_calibration, ratio=16, input_ids=ids)
    magic, version, flags, hlen, _ = struct.unpack_from("<4sHHII", blob, 0)
    header = json.loads(blob[16 : 16 + hlen])
    assert version == 5 and header["predicted"] is True
    for change in ("version", "flag"):
        h = dict(header)
        v = version
        if change == "version":
            v = 4
        else:
            del h["predicted"]
        raw = json.dumps(h, separators=(",", ":"), sort_keys=True).encode()
        bad = struct.pack("<4sHHII", magic, v, flags, len(raw), zlib.crc32(raw)) + raw + blob[16 + hlen :]
        with pytest.raises(FormatError, match="token ids"):
            restore_cache(bad, model, calibration=small_calibration)
