"""RopeSpec reproduces each tiny model's own rotation exactly, inverts it, and serialises strictly."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtc.errors import FormatError, LayoutError, UnsupportedModel
from kvtc.integrations.hf import rope_spec_from_config
from kvtc.rope import RopeKind, RopeSpec
from tiny_models import TINY, build, pre_rope_key_hooks

TOL = 1e-5
NAMES = sorted(TINY)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def models() -> dict:
    return {name: build(name) for name in NAMES}


@pytest.fixture(scope="module")
def specs(models) -> dict[str, RopeSpec]:
    return {name: rope_spec_from_config(m.config) for name, m in models.items()}


def model_rotation(model, layer: int, keys: torch.Tensor, positions: torch.Tensor, nope=()) -> torch.Tensor:
    """The model's own rotation of ``keys`` ``[batch, heads, tokens, head_dim]``: its rotary embedding's cos / sin
    and its modeling module's ``apply_rotary_pos_emb`` (identity on a layer that skips RoPE)."""
    attn = model.model.layers[layer].self_attn
    if layer in nope:
        return keys
    rotary = model.model.rotary_emb
    if isinstance(rotary.rope_type, dict):
        cos, sin = rotary(keys, positions, model.config.layer_types[layer])
    else:
        cos, sin = rotary(keys, positions)
    apply = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    width = getattr(attn, "rotary_ndims", keys.shape[-1])  # StableLM splits the rotary part off first
    return torch.cat((apply(keys[..., :width], keys[..., :width], cos, sin)[1], keys[..., width:]), dim=-1)


def to_slice(k: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, tokens, d]`` -> ``[batch, tokens, 1 layer, heads, d]``."""
    return k.transpose(1, 2)[:, :, None]


def position_sets(name: str) -> list[torch.Tensor]:
    top = TINY[name].max_position
    short = torch.randint(0, min(top, 1000), (2, 24))
    long = torch.randint(0, top, (2, 24))
    long[1, -1] = top - 1  # longrope: one forward reaching past original_max_position_embeddings
    return [short, long]


@pytest.mark.parametrize("name", NAMES)
def test_apply_and_invert_match_the_models_rotation(name, models, specs):
    model, spec = models[name], specs[name]
    cfg = model.config
    for layer in TINY[name].kv_layers:
        for positions in position_sets(name):
            pre = torch.randn(2, cfg.num_key_value_heads, positions.shape[1], spec.head_dim)
            want = model_rotation(model, layer, pre, positions, TINY[name].nope_layers)
            got = spec.apply(to_slice(pre), positions, [layer])
            assert rel_err(got, to_slice(want)) <= TOL, (name, layer)
            back = spec.invert(to_slice(want), positions, [layer])
            assert rel_err(back, to_slice(pre)) <= TOL, (name, layer)


@pytest.mark.parametrize("name", NAMES)
def test_spec_turns_captured_pre_rope_keys_into_the_cache_keys(name, models, specs):
    """Run the model; pre-RoPE keys captured at k_proj / k_norm, rotated by the spec, are the cache's keys."""
    model, spec = models[name], specs[name]
    captured: dict[int, torch.Tensor] = {}
    handles = pre_rope_key_hooks(model, captured)
    try:
        ids = torch.randint(3, model.config.vocab_size, (2, 11))
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
    finally:
        for h in handles:
            h.remove()
    positions = torch.arange(11).expand(2, 11)
    assert sorted(captured) == list(TINY[name].kv_layers)
    for layer, pre in captured.items():
        post = cache.layers[layer].keys.transpose(1, 2)[:, :, None]  # [batch, tokens, 1, heads, d]
        assert rel_err(spec.apply(pre[:, :, None], positions, [layer]), post) <= TOL, (name, layer)
        assert rel_err(spec.invert(post, positions, [layer]), pre[:, :, None]) <= TOL, (name, layer)
    # A layer that skips RoPE leaves its keys untouched (SmolLM3's NoPE layers).
    nope = [i for i in TINY[name].kv_layers if spec.layer_kinds[i] is None]
    for layer in nope:
        assert torch.equal(cache.layers[layer].keys.transpose(1, 2), captured[layer])
    assert tuple(nope) == TINY[name].nope_layers


def test_cos_sin_are_the_models_for_a_half_split_model_with_scaling(models, specs):
    model, spec = models["qwen3_yarn"], specs["qwen3_yarn"]
    assert spec.kinds[0].attention_scaling > 1.0
    positions = torch.randint(0, 4096, (3, 7))
    want_cos, want_sin = model.model.rotary_emb(torch.zeros(1), positions)
    cos, sin = spec.cos_sin(positions, 0)
    assert cos.shape == (3, 7, spec.head_dim)
    assert rel_err(cos, want_cos) <= TOL and rel_err(sin, want_sin) <= TOL


def test_cos_sin_pass_through_dims_for_partial_rotary(specs):
    spec = specs["phi3_longrope"]
    r = spec.kinds[0].rotary_dim
    assert r == 12 < spec.head_dim == 16
    cos, sin = spec.cos_sin(torch.arange(5), 1)
    assert torch.equal(cos[..., r:], torch.ones(5, 4)) and torch.equal(sin[..., r:], torch.zeros(5, 4))


def test_variants_are_read_from_the_model(specs):
    assert specs["glm"].interleaved and specs["glm"].kinds[0].rotary_dim == 8
    assert not specs["stablelm"].interleaved and specs["stablelm"].kinds[0].rotary_dim == 4
    assert not specs["llama"].interleaved
    assert specs["qwen3_next"].kinds[0].rotary_dim == 4  # partial_rotary_factor 0.25 of 16
    assert specs["phi3_longrope"].kinds[0].long_from == 1024
    assert specs["llama_dynamic"].kinds[0].max_positions == 64
    assert specs["smollm3"].layer_kinds == ("shared", None, "shared", None)


def test_gemma3_layer_types_get_their_own_theta(specs):
    spec = specs["gemma3"]
    assert spec.layer_kinds == ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    local, full = spec.kind_of(0), spec.kind_of(1)
    assert local.rope_type == "default" and full.rope_type == "linear"
    # The second frequency is theta^(-2/256): 1e4 locally, 1e6 globally and divided by the linear factor 8.
    assert local.inv_freq[1] == pytest.approx(1e4 ** (-2 / 256), rel=1e-6)
    assert full.inv_freq[1] == pytest.approx(1e6 ** (-2 / 256) / 8, rel=1e-6)
    x = torch.randn(1, 5, 2, 1, 256)
    pos = torch.arange(100, 105)[None]
    assert not torch.allclose(spec.apply(x, pos, [0, 1])[:, :, 0], spec.apply(x, pos, [1, 0])[:, :, 0])


def test_dynamic_rope_is_exact_below_its_limit_and_refuses_beyond(specs):
    spec = specs["llama_dynamic"]
    x = torch.randn(1, 2, 1, 2, 16)
    spec.apply(x, torch.tensor([[10, 63]]), [0])
    with pytest.raises(UnsupportedModel, match="max_position_embeddings"):
        spec.apply(x, torch.tensor([[10, 64]]), [0])
    with pytest.raises(UnsupportedModel):
        spec.invert(x, torch.tensor([[10, 64]]), [0])


def test_longrope_switches_to_long_factors_with_the_largest_position(specs):
    spec = specs["phi3_longrope"]
    x = torch.randn(1, 2, 1, 2, 16)
    short = spec.apply(x, torch.tensor([[5, 1023]]), [0])
    long = spec.apply(x, torch.tensor([[5, 1024]]), [0])
    assert not torch.allclose(short[:, 0], long[:, 0])  # same position 5, other frequencies


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes_are_kept_and_float64_inverts_to_rounding(specs, dtype):
    spec = specs["qwen3_yarn"]
    x = torch.randn(2, 9, 2, 2, 16, dtype=torch.float64).to(dtype)
    pos = torch.randint(0, 4096, (2, 9))
    y = spec.apply(x, pos, [0, 1])
    assert y.dtype == dtype
    if dtype == torch.float64:
        assert rel_err(spec.invert(y, pos, [0, 1]), x) < 1e-13


def test_spec_serialises_canonically(specs):
    for name, spec in specs.items():
        d = json.loads(json.dumps(spec.to_dict()))
        again = RopeSpec.from_dict(d)
        assert again == spec and again.fingerprint() == spec.fingerprint(), name
    # Equal specs mean equal rotations: Qwen2, Qwen3 and Mistral share theta 1e6 and head_dim; the others differ.
    assert specs["qwen2"] == specs["qwen3"] == specs["mistral_sliding"]
    prints = {s.fingerprint() for n, s in specs.items() if n not in ("qwen3", "mistral_sliding")}
    assert len(prints) == len(specs) - 2


def test_rebuilding_from_the_same_config_gives_an_equal_spec(models, specs):
    assert rope_spec_from_config(models["gemma3"].config) == specs["gemma3"]
    assert rope_spec_from_config(models["gemma3"].config).fingerprint() == specs["gemma3"].fingerprint()


def _broken(spec: RopeSpec, change) -> dict:
    d = json.loads(json.dumps(spec.to_dict()))
    change(d)
    return d


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda d: d.pop("head_dim"), FormatError, "missing"),
        (lambda d: d.update(extra=1), FormatError, "unknown"),
        (lambda d: d.update(version=2), FormatError, "version"),
        (lambda d: d.update(head_dim="16"), FormatError, "head_dim"),
        (lambda d: d.update(interleaved=1), FormatError, "interleaved"),
        (lambda d: d.update(layer_kinds=["nope"]), FormatError, "nope"),
        (lambda d: d.update(layer_kinds=[]), FormatError, "layer_kinds"),
        (lambda d: d["kinds"][0].update(rope_type="quantum"), UnsupportedModel, "quantum"),
        (lambda d: d["kinds"][0].update(inv_freq=[0.1] * 8), FormatError, "float32"),
        (lambda d: d["kinds"][0].update(inv_freq=[1.0] * 9), FormatError, "rotates 18"),
        (lambda d: d["kinds"][0].update(inv_freq=[float("nan")] * 8), FormatError, "finite"),
        (lambda d: d["kinds"][0].update(attention_scaling=0.0), FormatError, "positive"),
        (lambda d: d["kinds"][0].update(max_positions=10), FormatError, "dynamic"),
        (lambda d: d["kinds"][0].pop("long_from"), FormatError, "missing"),
        (lambda d: d.update(kinds="x"), FormatError, "kinds"),
    ],
)
def test_from_dict_rejects_malformed_specs(specs, change, error, match):
    with pytest.raises(error, match=match):
        RopeSpec.from_dict(_broken(specs["llama"], change))


def test_from_dict_checks_longrope_and_dynamic_fields(specs):
    with pytest.raises(FormatError, match="long_inv_freq"):
        RopeSpec.from_dict(_broken(specs["phi3_longrope"], lambda d: d["kinds"][0].update(long_inv_freq=[1.0])))
    with pytest.raises(FormatError, match="max_positions"):
        RopeSpec.from_dict(_broken(specs["llama_dynamic"], lambda d: d["kinds"][0].update(max_positions=None)))
    with pytest.raises(FormatError, match="mapping"):
        RopeSpec.from_dict([1, 2])


def test_shape_errors_are_typed(specs):
    spec = specs["llama"]
    x = torch.randn(1, 3, 1, 2, 16)
    with pytest.raises(LayoutError, match="int64"):
        spec.apply(x, torch.zeros(1, 3, dtype=torch.int32), [0])
    with pytest.raises(LayoutError, match="positions"):
        spec.apply(x, torch.zeros(1, 4, dtype=torch.int64), [0])
    with pytest.raises(LayoutError, match="layers"):
        spec.apply(x, torch.zeros(1, 3, dtype=torch.int64), [0, 1])
    with pytest.raises(LayoutError, match="not a layer"):
        spec.apply(x, torch.zeros(1, 3, dtype=torch.int64), [2])
    with pytest.raises(LayoutError, match="non-negative"):
        spec.apply(x, torch.full((1, 3), -1, dtype=torch.int64), [0])


def test_unsupported_configs_are_refused_clearly():
    from transformers import DeepseekV3Config, GPT2Config, Qwen2VLConfig

    with pytest.raises(UnsupportedModel, match="latent attention"):
        rope_spec_from_config(DeepseekV3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4))
    with pytest.raises(UnsupportedModel, match="rotary"):
        rope_spec_from_config(GPT2Config(n_layer=2, n_embd=64, n_head=4))
    with pytest.raises(UnsupportedModel):  # multimodal RoPE (3-D positions) is not a plain rotation
        rope_spec_from_config(
            Qwen2VLConfig(
                text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
            )
        )
    with pytest.raises(UnsupportedModel, match="config"):
        rope_spec_from_config({"rope_theta": 1e4})


@settings(max_examples=40, deadline=None)
@given(
    half=st.integers(1, 8),
    extra=st.integers(0, 4),
    interleaved=st.booleans(),
    scaling=st.floats(0.5, 2.0),
    seed=st.integers(0, 2**16),
)
def test_invert_undoes_apply_for_any_spec(half, extra, interleaved, scaling, seed):
    gen = torch.Generator().manual_seed(seed)
    inv_freq = tuple(float(v) for v in torch.rand(half, generator=gen))
    kind = RopeKind("shared", "yarn", inv_freq, scaling)
    spec = RopeSpec(2 * half + extra, interleaved, (kind,), ("shared", None))
    x = torch.randn(2, 5, 2, 3, spec.head_dim, generator=gen, dtype=torch.float64)
    pos = torch.randint(0, 100_000, (2, 5), generator=gen)
    y = spec.apply(x, pos, [0, 1])
    assert torch.equal(y[:, :, 1], x[:, :, 1])  # no-RoPE layer untouched
    assert torch.equal(y[..., 2 * half :][:, :, 0], x[..., 2 * half :][:, :, 0])  # pass-through dims untouched
    # Rotation keeps pair norms up to the scaling.
    norms = (y[:, :, 0, :, : 2 * half] ** 2).sum(-1).sqrt()
    assert torch.allclose(norms, scaling * (x[:, :, 0, :, : 2 * half] ** 2).sum(-1).sqrt(), rtol=1e-12)
    assert rel_err(spec.invert(y, pos, [0, 1]), x) < 1e-13


def test_the_rope_maths_does_not_import_transformers():
    """kvtc.rope is pure maths: loading and applying a stored spec needs no transformers."""
    import os
    import subprocess

    code = (
        "import sys, torch; from kvtc.rope import RopeKind, RopeSpec; "
        "s = RopeSpec(4, False, (RopeKind('shared', 'default', (1.0, 0.5)),), ('shared',)); "
        "s = RopeSpec.from_dict(s.to_dict()); s.invert(torch.ones(1, 2, 1, 1, 4), torch.arange(2)[None], [0]); "
        "assert 'transformers' not in sys.modules, 'kvtc.rope imported transformers'"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
