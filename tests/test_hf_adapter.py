"""transformers adapter: layouts by real layer index; extract -> rebuild continues exactly like the original cache."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, DynamicCache

from kvtc.errors import LayoutError, UnsupportedModel
from kvtc.integrations.hf import describe_model, extract_slice, rebuild_cache, rope_spec_from_config
from kvtc.layout import KVSlice
from tiny_models import TINY, build, gemma3_small_window, pre_rope_key_hooks

NAMES = sorted(TINY)
LOGIT_TOL = 1e-4
HYBRID = {"qwen3_next"}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def models() -> dict:
    return {name: build(name) for name in NAMES}


def prefill(model, batch: int = 2, tokens: int = 10, cache=None):
    ids = torch.randint(3, model.config.vocab_size, (batch, tokens))
    with torch.no_grad():
        out = model(ids, use_cache=True, past_key_values=cache)
    return ids, out.past_key_values


def next_logits(model, cache, token: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(token, past_key_values=cache, use_cache=True).logits[:, -1]


@pytest.mark.parametrize("name", NAMES)
def test_describe_model_names_real_kv_layers(name, models):
    model = models[name]
    layout, spec = describe_model(model)
    cfg = model.config
    assert layout.layers == TINY[name].kv_layers
    assert layout.num_kv_heads == cfg.num_key_value_heads
    assert layout.head_dim == spec.head_dim == (getattr(cfg, "head_dim", None) or 16)
    assert layout.dtype == "float32"
    from_config, spec2 = describe_model(cfg)
    assert from_config == dataclasses.replace(layout, dtype="bfloat16") and spec2 == spec


def test_hybrid_model_keeps_real_layer_indices(models):
    model = models["qwen3_next"]
    assert model.config.layer_types[3] == model.config.layer_types[7] == "full_attention"
    _, cache = prefill(model)
    kv = extract_slice(cache, model)
    assert kv.layout.layers == (3, 7)
    assert torch.equal(kv.values[:, :, 1], cache.layers[7].values.transpose(1, 2))


@pytest.mark.parametrize("name", NAMES)
def test_extract_then_rebuild_continues_like_the_untouched_cache(name, models):
    model = models[name]
    _, cache = prefill(model, batch=2, tokens=10)
    kv = extract_slice(cache, model, model_id=name)
    assert isinstance(kv, KVSlice) and kv.batch == 2 and kv.num_tokens == 10 and kv.model_id == name
    assert kv.layout.layers == TINY[name].kv_layers
    assert torch.equal(kv.positions, torch.arange(10).expand(2, 10))

    rebuilt = rebuild_cache(kv, model, linear_states=cache if name in HYBRID else None)
    for li in kv.layout.layers:  # the rebuilt cache holds the model's own post-RoPE keys
        assert rel_err(rebuilt.layers[li].keys, cache.layers[li].keys) <= 1e-5
        assert torch.equal(rebuilt.layers[li].values, cache.layers[li].values)
    assert rebuilt.get_seq_length() == cache.get_seq_length() == 10

    token = torch.randint(3, model.config.vocab_size, (2, 1))
    want = next_logits(model, copy.deepcopy(cache), token)
    got = next_logits(model, rebuilt, token)
    assert rel_err(got, want) <= LOGIT_TOL


def test_extracted_keys_are_the_pre_rope_keys_the_model_computed(models):
    model = models["qwen3"]
    captured: dict[int, torch.Tensor] = {}
    handles = pre_rope_key_hooks(model, captured)
    try:
        _, cache = prefill(model)
    finally:
        for h in handles:
            h.remove()
    kv = extract_slice(cache, model)
    for i, li in enumerate(kv.layout.layers):
        assert rel_err(kv.keys[:, :, i], captured[li]) <= 1e-5


def test_linear_states_must_come_from_the_same_model(models):
    _, llama_cache = prefill(models["llama"])
    _, hybrid_cache = prefill(models["qwen3_next"])
    kv = extract_slice(hybrid_cache, models["qwen3_next"])
    with pytest.raises(LayoutError, match="same model"):
        rebuild_cache(kv, models["qwen3_next"], linear_states=llama_cache)


def test_hybrid_needs_its_recurrent_state_to_continue(models):
    model = models["qwen3_next"]
    _, cache = prefill(model)
    token = torch.randint(3, model.config.vocab_size, (2, 1))
    want = next_logits(model, copy.deepcopy(cache), token)
    without = next_logits(model, rebuild_cache(extract_slice(cache, model), model), token)
    assert rel_err(without, want) > 1e-2  # linear layers restarted from an empty state


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_next"])
def test_generate_continues_from_a_rebuilt_cache(name, models):
    model = models[name]
    ids, cache = prefill(model, batch=2, tokens=9)
    rebuilt = rebuild_cache(extract_slice(cache, model), model, linear_states=cache if name in HYBRID else None)
    nxt = torch.randint(3, model.config.vocab_size, (2, 1))
    full = torch.cat([ids, nxt], dim=1)
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(full, past_key_values=copy.deepcopy(cache), **kwargs)
        got = model.generate(full, past_key_values=rebuilt, **kwargs)
    assert torch.equal(got, want)


def test_sliding_layers_hold_only_their_window_and_rebuild_exactly():
    """The model's own cache (sliding layers keep their newest 3 tokens) is extracted as it is and rebuilt to an
    identical cache; a config-less cache (every token kept) gives the same slice."""
    model = AutoModelForCausalLM.from_config(gemma3_small_window(), dtype=torch.float32).eval()
    torch.manual_seed(0)
    _, cache = prefill(model, tokens=10)  # window 4: sliding layers keep the last 3 tokens only
    assert cache.layers[0].keys.shape[2] == 3
    kv = extract_slice(cache, model)
    assert kv.num_tokens == 10 and kv.layout.max_tokens == (3, 0, 3, 0)
    assert not kv.keys[:, :7, [0, 2]].any() and not kv.values[:, :7, [0, 2]].any()
    assert kv.values[:, 7:, 0].transpose(1, 2).equal(cache.layers[0].values)
    torch.manual_seed(0)  # the same tokens
    _, full_history = prefill(model, tokens=10, cache=DynamicCache())
    same = extract_slice(full_history, model)
    assert torch.allclose(same.keys, kv.keys, atol=1e-5) and torch.allclose(same.values, kv.values, atol=1e-5)
    rebuilt = rebuild_cache(kv, model)
    for li in range(4):
        assert rel_err(rebuilt.layers[li].keys, cache.layers[li].keys) <= 1e-5
        assert rebuilt.layers[li].values.equal(cache.layers[li].values)
    assert rebuilt.layers[0].cumulative_length == cache.layers[0].cumulative_length == 10
    token = torch.randint(3, model.config.vocab_size, (2, 1))
    assert rel_err(next_logits(model, rebuilt, token), next_logits(model, cache, token)) <= LOGIT_TOL
    every = extract_slice(full_history, model, every_token=True)  # calibration rows: all tokens of all layers
    assert every.layout.max_tokens == () and every.keys[:, :7, 0].abs().sum() > 0


def test_sliding_model_with_full_history_cache_rebuilds_to_a_windowed_cache():
    model = AutoModelForCausalLM.from_config(gemma3_small_window(), dtype=torch.float32).eval()
    _, cache = prefill(model, tokens=10, cache=DynamicCache())  # no config: every layer keeps all tokens
    kv = extract_slice(cache, model)
    assert kv.num_tokens == 10
    rebuilt = rebuild_cache(kv, model)
    assert rebuilt.layers[0].keys.shape[2] == 3 and rebuilt.layers[1].keys.shape[2] == 10
    token = torch.randint(3, model.config.vocab_size, (2, 1))
    assert rel_err(next_logits(model, rebuilt, token), next_logits(model, cache, token)) <= LOGIT_TOL


def test_explicit_positions_are_used_for_the_rotation(models):
    model = models["llama"]
    _, cache = prefill(model, batch=1, tokens=6)
    shifted = torch.arange(100, 106)[None]
    kv = extract_slice(cache, model, positions=shifted)
    assert torch.equal(kv.positions, shifted)
    spec = rope_spec_from_config(model.config)
    keys = torch.stack([cache.layers[i].keys.transpose(1, 2) for i in (0, 1)], dim=2)
    assert torch.equal(kv.keys, spec.invert(keys, shifted, (0, 1)))
    rebuilt = rebuild_cache(kv, model)  # same positions back: the cache is restored
    assert rel_err(rebuilt.layers[1].keys, cache.layers[1].keys) <= 1e-5
    with pytest.raises(LayoutError, match="positions"):
        extract_slice(cache, model, positions=torch.arange(5)[None])


def test_bfloat16_model_round_trips_in_its_dtype():
    model = build("llama", dtype=torch.bfloat16)
    _, cache = prefill(model)
    kv = extract_slice(cache, model)
    assert kv.layout.dtype == "bfloat16" and kv.keys.dtype == torch.bfloat16
    rebuilt = rebuild_cache(kv, model)
    assert rebuilt.layers[0].keys.dtype == torch.bfloat16
    # Two bf16 roundings (pre-RoPE keys, then re-rotated keys) stay within a few bf16 ulps.
    assert rel_err(rebuilt.layers[0].keys.float(), cache.layers[0].keys.float()) <= 2e-2


def test_a_model_cast_after_loading_is_refused():
    model = build("llama").to(torch.bfloat16)  # casts the rotary inv_freq buffer too: the rotation changes
    with pytest.raises(UnsupportedModel, match="inv_freq"):
        describe_model(model)


def test_rebuild_from_a_config_keeps_the_slice_dtype(models):
    model = models["llama"]
    _, cache = prefill(model)
    rebuilt = rebuild_cache(extract_slice(cache, model), model.config)
    assert rebuilt.layers[0].keys.dtype == torch.float32


def test_rebuild_refuses_a_slice_of_another_layout(models):
    _, cache = prefill(models["llama"])
    kv = extract_slice(cache, models["llama"])
    with pytest.raises(LayoutError, match="not this model's"):
        rebuild_cache(kv, models["gemma3"])
    shard = KVSlice(
        layout=kv.layout.shard((1,)), keys=kv.keys[:, :, :, 1:], values=kv.values[:, :, :, 1:], positions=kv.positions
    )
    with pytest.raises(LayoutError, match="shards"):
        rebuild_cache(shard, models["llama"])


def test_extract_refuses_empty_or_foreign_caches(models):
    model = models["llama"]
    with pytest.raises(LayoutError, match="no keys"):
        extract_slice(DynamicCache(config=model.config), model)
    with pytest.raises(LayoutError, match="Cache"):
        extract_slice({"keys": 1}, model)
    _, other = prefill(models["gemma3"])
    with pytest.raises(UnsupportedModel, match="expected"):
        extract_slice(other, model)  # gemma3's 1 KV head of 256 is not llama's 2 heads of 16


def test_unsupported_models_are_refused_clearly():
    from transformers import Gemma4TextConfig

    gemma4 = Gemma4TextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128
    )
    with pytest.raises(UnsupportedModel, match="differ in head_dim"):  # global layers use wider heads
        describe_model(gemma4)
    with pytest.raises(UnsupportedModel, match="latent attention"):
        describe_model(DeepseekV3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4))
    with pytest.raises(UnsupportedModel, match="model or config"):
        describe_model("meta-llama/Llama-3.1-8B")


def test_layers_that_rotate_otherwise_than_the_config_says_are_refused(monkeypatch):
    """Cohere 2 rotates only in its sliding layers, a rule of its attention code, not of its config: without that
    rule kvtc would read layer 3 as rotated; the check on the loaded model (one token at two positions) refuses it."""
    import kvtc.integrations.hf.rope_probe as rope_probe

    monkeypatch.delitem(rope_probe.ROPE_ONLY_IN_SLIDING_LAYERS, "cohere2")
    model = build("cohere2")
    with pytest.raises(UnsupportedModel, match=r"layers \[3\] of Cohere2ForCausalLM rotate their keys otherwise"):
        describe_model(model)
    monkeypatch.undo()
    _, spec = describe_model(build("cohere2"))  # with the rule: layer 3 unrotated, and the model agrees
    assert spec.layer_kinds == ("shared", "shared", "shared", None)


@pytest.mark.parametrize("name", ["cohere2", "exaone4"])
def test_without_a_sliding_window_the_rope_rule_follows_the_attention_code(name):
    """Cohere 2 without a sliding window rotates no layer, EXAONE 4 every layer; the model's own check agrees."""
    config = TINY[name].build_config().to_dict()
    config.update(sliding_window=None, layer_types=["full_attention"] * 4)
    config = type(TINY[name].build_config())(**{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _, spec = describe_model(model)
    assert spec.layer_kinds == ((None,) * 4 if name == "cohere2" else ("shared",) * 4)


def test_the_adapter_is_read_once_per_model():
    """Describing, compressing, restoring, extracting and rebuilding all share one adapter: the rotary embedding
    is built and probed once per model, however many calls follow."""
    from kvtc.codec import Codec
    from kvtc.integrations.hf import ModelAdapter, adapter_for, compress_cache, restore_cache

    model = build("llama")  # a fresh model: no adapter read for its config yet
    before = ModelAdapter.builds
    layout, spec = describe_model(model)
    _, cache = prefill(model)
    blob = compress_cache(cache, model, Codec.identity(), dtype=None)
    restored = restore_cache(blob, model)
    rebuild_cache(extract_slice(restored, model), model.config)
    assert describe_model(model.config)[1] is spec
    assert ModelAdapter.builds == before + 1
    assert adapter_for(model) is adapter_for(model.config)
    assert rel_err(restored.layers[1].keys, cache.layers[1].keys) <= 1e-5


def test_a_config_changed_in_place_is_read_again():
    config = copy.deepcopy(build("llama").config)
    _, spec = describe_model(config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 500.0}
    _, changed = describe_model(config)
    assert changed.fingerprint() != spec.fingerprint()
    assert changed == rope_spec_from_config(copy.deepcopy(config))


def test_the_adapter_cache_does_not_keep_models_alive():
    import gc
    import weakref

    from kvtc.integrations.hf import adapter_for
    from kvtc.integrations.hf.adapter import _ADAPTERS

    model = build("llama")
    adapter, config = adapter_for(model), weakref.ref(model.config)
    assert id(model.config) in _ADAPTERS
    key = id(model.config)
    del model
    gc.collect()
    assert config() is None and key not in _ADAPTERS
    with pytest.raises(UnsupportedModel, match="no longer exists"):
        _ = adapter.config


def test_rebuild_from_layers_handed_over_one_at_a_time_equals_rebuild(models):
    from kvtc.codec import Codec
    from kvtc.integrations.hf import rebuild_cache_from_layers

    model = models["llama"]
    _, cache = prefill(model, batch=2, tokens=10)
    kv = extract_slice(cache, model)
    codec = Codec.identity()
    blob = codec.encode(kv)
    whole = rebuild_cache(codec.decode(blob), model)
    layered = rebuild_cache_from_layers(codec.decode_layers(blob), kv.positions, model)
    for li in kv.layout.layers:
        assert torch.equal(layered.layers[li].keys, whole.layers[li].keys)
        assert torch.equal(layered.layers[li].values, whole.layers[li].values)
    token = torch.randint(3, model.config.vocab_size, (2, 1))
    assert torch.equal(next_logits(model, layered, token), next_logits(model, whole, token))
    with pytest.raises(LayoutError):  # a layer missing
        rebuild_cache_from_layers(list(codec.decode_layers(blob))[1:], kv.positions, model)
