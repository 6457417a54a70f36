"""Every architecture of ``tiny_models`` through the whole pipeline: calibrate, compress, restore, continue.

Seeded random models (their weights do not matter here, their attention layouts and rotations do): a calibration
fitted on the model's own KV of a small text through a byte-level tokenizer, a 4x blob of a cache whose sliding
layers hold only their window, and the identity blob, which must continue exactly as the model's own cache."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from kvtc.calibration import Recipe
from kvtc.codec import Codec
from kvtc.integrations.hf import compress_cache, restore_cache
from kvtc.integrations.hf_calibrate import calibrate_model
from tiny_models import TINY, VOCAB, build

#: hybrid models need their recurrent states beside the blob (tests/test_hf_cache.py covers them); Gemma 3's
#: heads of 256 make a slow calibration, and the real model runs this path in tests/test_gemma3.py
NAMES = sorted(n for n in TINY if n not in ("qwen3_next", "gemma3"))
TOKENS = 40
#: the newest tokens stored raw (the sliding layers of window 16 hold 15 tokens: 7 of them coded)
WINDOW = 8


class ByteTokenizer:
    """The text's UTF-8 bytes as token ids 3..VOCAB-1, BOS 1 first: a tokenizer for a tiny random model."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text, add_special_tokens=True, verbose=False, **_):  # noqa: ANN001, ANN204
        ids = [3 + b % (VOCAB - 3) for b in str(text).encode()]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}


def texts(seed: int = 0, count: int = 4) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "state", "of", "union", "kv", "cache", "model", "layer", "token", "rotation", "window", "a"]
    return [" ".join(rng.choice(words) for _ in range(400)) for _ in range(count)]


def next_logits(model, cache, step):  # noqa: ANN001, ANN201
    with torch.no_grad():
        return model(step, past_key_values=cache, use_cache=True).logits[:, -1]


@pytest.mark.parametrize("name", NAMES)
def test_architecture_round_trips_through_a_calibrated_blob(name):
    model = build(name)
    recipe = Recipe(tokens=600, window=64, sinks=4, ratios=(4,), sensitivity="none", dp_rows=256)
    cal = calibrate_model(model, ByteTokenizer(), texts(), recipe, progress=False)
    ids = torch.tensor([ByteTokenizer()(texts(seed=1, count=1)[0])["input_ids"][:TOKENS]])  # text not calibrated on
    with torch.no_grad():
        cache = model(ids, use_cache=True, past_key_values=DynamicCache(config=model.config)).past_key_values
    step = torch.randint(3, VOCAB, (1, 1))
    want = next_logits(model, _copy(cache), step)

    exact = restore_cache(compress_cache(cache, model, Codec.identity(), dtype=None), model)
    assert torch.allclose(next_logits(model, exact, step), want, atol=1e-5), name

    blob = compress_cache(cache, model, Codec(cal, 4, sinks=4, window=WINDOW), dtype=None, input_ids=ids)
    info = Codec.inspect(blob)
    held = {i: int(cache.layers[li].keys.shape[2]) for i, li in enumerate(TINY[name].kv_layers)}
    assert sorted(h for sp in info["spans"] for h in [sp["held"]] * len(sp["layers"])) == sorted(held.values())
    restored = restore_cache(blob, model, calibration=cal)
    for li in TINY[name].kv_layers:
        for kind in ("keys", "values"):
            a, b = getattr(cache.layers[li], kind), getattr(restored.layers[li], kind)
            assert a.shape == b.shape, (name, li, kind)
            coded = slice(4 if a.shape[2] == TOKENS else 0, a.shape[2] - WINDOW)  # sinks and window raw
            rel = float((a[:, :, coded] - b[:, :, coded]).norm() / a[:, :, coded].norm())
            assert 1e-4 < rel < 0.25, (name, li, kind, rel)  # coded at 4x: close, yet not stored raw
            tail = float((a[:, :, -WINDOW:] - b[:, :, -WINDOW:]).abs().max() / a[:, :, -WINDOW:].abs().max())
            assert tail < 1e-5, (name, li, kind, tail)  # raw, through the RoPE round trip of float32 keys
    assert torch.isfinite(next_logits(model, restored, step)).all()


def _copy(cache):  # noqa: ANN001, ANN202
    import copy

    return copy.deepcopy(cache)
