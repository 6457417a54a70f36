"""transformers cache round trip: compress_cache -> bytes -> restore_cache continues generation; typed refusals."""

from __future__ import annotations

import copy
import errno
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from fixtures_smollm2 import heldout, small_calibration  # noqa: F401
from kvtc import fileio
from kvtc.codec import Codec
from kvtc.errors import CalibrationError, CalibrationMismatch, FormatError, LayoutError, StoreError
from kvtc.integrations.hf import (
    ModelAdapter,
    adapter_for,
    compress_cache,
    extract_slice,
    load_blob,
    rebuild_cache,
    restore_cache,
    save_blob,
)
from tiny_models import build, gemma3

#: greedy tokens that must match exactly after a lossless round trip (acceptance 2)
GREEDY_TOKENS = 32
#: measured on the held-out window (8K-token calibration: 0.94; the 100K default does at least as well): 16x top-1 agreement over
#: 32 teacher-forced tokens (32x ~0.81); a codec that mis-rotated keys or mixed up layers falls far below
MIN_TOP1_AT_16X = 0.8
#: perplexity of the scored tokens may rise at most this much at 16x (measured: +1-3%)
MAX_PPL_RISE_AT_16X = 0.10


def next_logits(model, cache, ids):
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True).logits[:, -1]


# ---------------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("batch", [1, 3])
def test_identity_round_trip_tiny_llama_any_batch(batch):
    model = build("llama")
    ids = torch.randint(3, 128, (batch, 12))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    blob = compress_cache(cache, model, Codec.identity(), dtype=None)
    restored = restore_cache(blob, model)
    step = torch.randint(3, 128, (batch, 1))
    assert torch.allclose(next_logits(model, restored, step), next_logits(model, cache, step), atol=1e-5)
    assert Codec.inspect(blob)["batch"] == batch


def test_rebuilt_cache_owns_its_tensors_and_keeps_growing():
    """rebuild_cache stores each layer's tensors without a copy through update(); the cache must still own them
    (an in-place write into it leaves the slice alone, also for one token of one sequence, where a permute
    could return the slice's own memory) and grow like a cache the model filled itself."""
    model = build("llama")
    for batch, tokens in ((1, 1), (2, 9)):
        ids = torch.randint(3, 128, (batch, tokens + 1))
        with torch.no_grad():
            cache = model(ids[:, :-1], use_cache=True).past_key_values
        kv = extract_slice(cache, model)
        keys0, values0 = kv.keys.clone(), kv.values.clone()
        rebuilt = rebuild_cache(kv, model)
        for layer in rebuilt.layers:
            assert layer.keys.is_contiguous() and layer.values.is_contiguous()
            layer.keys.add_(1.0)
            layer.values.add_(1.0)
        assert torch.equal(kv.keys, keys0) and torch.equal(kv.values, values0)
        fresh = rebuild_cache(kv, model)
        step = ids[:, -1:]
        assert torch.allclose(next_logits(model, fresh, step), next_logits(model, cache, step), atol=1e-5)
        assert fresh.get_seq_length() == tokens + 1  # the step's token was appended after the rebuilt ones


def test_sliding_window_model_round_trip():
    """Gemma-3 style: sliding layers (window 32) and full layers; a config-less cache keeps all 48 tokens, and
    the restored cache trims the sliding layers to their window as the model itself would."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma3(sliding_window=32), dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (2, 48))
    with torch.no_grad():
        cache = model(ids, use_cache=True, past_key_values=DynamicCache()).past_key_values
        reference = model(ids, use_cache=True, past_key_values=DynamicCache(config=model.config)).past_key_values
    # the model's own cache (sliding layers already trimmed) stores only the tokens it holds
    blob = compress_cache(reference, model, Codec.identity(), dtype=None)
    info = Codec.inspect(blob)
    assert info["version"] == 2 and [sp["held"] for sp in info["spans"]] == [31, 48]
    held_bytes = sum(layer.keys.numel() * 4 for layer in reference.layers)
    assert {s["name"]: s["raw"] for s in info["sections"]}["raw.keys"] == held_bytes
    again = restore_cache(blob, model)
    restored = restore_cache(compress_cache(cache, model, Codec.identity(), dtype=None), model)
    assert restored.layers[0].keys.shape[2] < 48 == restored.layers[1].keys.shape[2]
    step = torch.randint(3, 128, (2, 1))
    want = next_logits(model, reference, step)
    assert torch.allclose(next_logits(model, restored, step), want, atol=1e-4)
    assert torch.allclose(next_logits(model, again, step), want, atol=1e-4)


def test_hybrid_model_needs_its_linear_states():
    model = build("qwen3_next")
    ids = torch.randint(3, 128, (1, 10))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    blob = compress_cache(cache, model, Codec.identity(), dtype=None)
    assert Codec.inspect(blob)["layout"]["layers"] == [3, 7]
    with pytest.raises(LayoutError, match="linear_states"):
        restore_cache(blob, model)
    restored = restore_cache(blob, model, linear_states=cache)
    step = torch.randint(3, 128, (1, 1))
    want = next_logits(model, copy.deepcopy(cache), step)
    assert torch.allclose(next_logits(model, restored, step), want, atol=1e-4)


# ---------------------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def prompt_ids(smollm2, heldout):
    context, _ = heldout
    return context[:, :256]


def greedy(model, ids, cache):
    with torch.no_grad():
        out = model.generate(
            ids, past_key_values=cache, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False
        )
    return out[:, ids.shape[1] :]


def prefix_cache(model, ids):
    """Cache of all but the last token (generate runs the last one), as transformers expects."""
    with torch.no_grad():
        return model(ids[:, :-1], use_cache=True).past_key_values


def test_smollm2_lossless_round_trips_generate_identical_tokens(smollm2, prompt_ids, tmp_path):
    model, _ = smollm2
    adapter, builds = adapter_for(model), ModelAdapter.builds
    want = greedy(model, prompt_ids, prefix_cache(model, prompt_ids))
    assert want.shape[1] == GREEDY_TOKENS

    rebuilt = rebuild_cache(extract_slice(prefix_cache(model, prompt_ids), model), model)
    assert torch.equal(greedy(model, prompt_ids, rebuilt), want)

    blob = compress_cache(prefix_cache(model, prompt_ids), model, Codec.identity(), dtype=None)
    path = save_blob(tmp_path / "prompt.kvtc", blob)
    restored = restore_cache(load_blob(path), model)
    assert torch.equal(greedy(model, prompt_ids, restored), want)
    assert adapter_for(model) is adapter and ModelAdapter.builds == builds  # generate leaves the config alone


@pytest.fixture(scope="module")
def context_cache(smollm2, heldout):
    model, _ = smollm2
    with torch.no_grad():
        return model(heldout[0], use_cache=True).past_key_values


def scored(model, cache, continuation):
    with torch.no_grad():
        logits = model(continuation, past_key_values=cache, use_cache=True).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1], continuation[0, 1:])
    return logits.argmax(-1), float(nll.exp())


def test_smollm2_16x_ratio_and_continuation(smollm2, heldout, context_cache, small_calibration):
    model, _ = smollm2
    _, continuation = heldout
    adapter, builds = adapter_for(model), ModelAdapter.builds
    blob = compress_cache(context_cache, model, calibration=small_calibration, ratio=16, input_ids=heldout[0])
    info = Codec.inspect(blob)
    print(
        f"16x on 2,048 held-out tokens: codec ratio {info['codec_ratio']:.2f}, whole-cache ratio "
        f"{info['whole_cache_ratio']:.2f}, {len(blob)} bytes"
    )
    assert info["tokens"] == 2048 and info["middle_tokens"] == 2048 - 4 - 128
    assert info["layout"]["dtype"] == "bfloat16"
    assert info["codec_ratio"] >= 16
    assert info["whole_cache_ratio"] == pytest.approx(info["original_bytes"] / len(blob))

    top_exact, ppl_exact = scored(model, copy.deepcopy(context_cache), continuation)
    restored = restore_cache(blob, model, small_calibration)
    assert restored.get_seq_length() == 2048
    top, ppl = scored(model, restored, continuation)
    agreement = float((top == top_exact).float().mean())
    print(f"top-1 agreement {agreement:.3f}, perplexity {ppl_exact:.2f} -> {ppl:.2f}")
    assert agreement >= MIN_TOP1_AT_16X
    assert ppl <= ppl_exact * (1 + MAX_PPL_RISE_AT_16X)
    assert adapter_for(model) is adapter and ModelAdapter.builds == builds  # checked and restored on one adapter


# ---------------------------------------------------------------------------------------- refusals


def test_calibration_of_another_model_is_refused(smollm2, small_calibration, context_cache, heldout):
    tiny = build("llama")
    with torch.no_grad():
        tiny_cache = tiny(torch.randint(3, 128, (1, 8)), use_cache=True).past_key_values
    with pytest.raises(CalibrationMismatch, match="use a calibration made for this model"):
        compress_cache(tiny_cache, tiny, calibration=small_calibration)
    blob = compress_cache(context_cache, smollm2[0], calibration=small_calibration, ratio=32, input_ids=heldout[0])
    with pytest.raises(CalibrationMismatch, match="made for another model"):
        restore_cache(blob, tiny, small_calibration)
    with pytest.raises(LayoutError, match="is not this model's"):  # an identity blob has no calibration to check
        restore_cache(compress_cache(context_cache, smollm2[0], Codec.identity()), tiny)
    with pytest.raises(CalibrationError, match="pass calibration="):
        restore_cache(blob, smollm2[0])


def test_model_with_other_rope_is_refused(smollm2, small_calibration, context_cache, heldout):
    model, _ = smollm2
    config = copy.deepcopy(model.config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 10_000.0}
    with torch.device("meta"):  # same layout, other RoPE; no weights needed to be refused
        other = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with pytest.raises(CalibrationMismatch, match="RoPE"):
        compress_cache(context_cache, other, calibration=small_calibration)
    blob = compress_cache(context_cache, model, calibration=small_calibration, ratio=32, input_ids=heldout[0])
    with pytest.raises(CalibrationMismatch, match="RoPE"):
        restore_cache(blob, other, small_calibration)


@pytest.fixture(scope="module")
def blob_32x(smollm2, small_calibration, context_cache, heldout):
    return compress_cache(context_cache, smollm2[0], calibration=small_calibration, ratio=32, input_ids=heldout[0])


@pytest.mark.parametrize("damage", ["truncate", "flip_section", "flip_header", "empty"])
def test_corrupt_or_truncated_blob_is_refused(smollm2, small_calibration, blob_32x, tmp_path, damage):
    data = bytearray(blob_32x)
    if damage == "truncate":
        data = data[: len(data) * 2 // 3]
    elif damage == "flip_section":
        data[-1000] ^= 0x40
    elif damage == "flip_header":
        data[40] ^= 0x01
    else:
        data = bytearray()
    path = tmp_path / "bad.kvtc"
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError):
        restore_cache(load_blob(path), smollm2[0], small_calibration) if damage != "flip_section" else restore_cache(
            bytes(data), smollm2[0], small_calibration
        )


# ---------------------------------------------------------------------------------------- save_blob


def test_save_blob_failure_leaves_the_good_file(tmp_path, monkeypatch):
    model = build("llama")
    with torch.no_grad():
        cache = model(torch.randint(3, 128, (1, 6)), use_cache=True).past_key_values
    good = compress_cache(cache, model, Codec.identity())
    path = save_blob(tmp_path / "conv.kvtc", good)
    newer = compress_cache(cache, model, Codec.identity(), dtype=None)

    def disk_full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio.os, "fsync", disk_full)
    with pytest.raises(StoreError, match="unchanged"):
        save_blob(path, newer)
    monkeypatch.undo()
    with pytest.raises(FormatError):  # not a container: refused before anything is written
        save_blob(path, b"not a kvtc blob")
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["conv.kvtc"]  # no temporary file left behind
    save_blob(path, newer)
    assert load_blob(path) == newer
