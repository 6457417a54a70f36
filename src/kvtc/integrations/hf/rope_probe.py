"""A model's :class:`~kvtc.rope.RopeSpec`, read from its transformers config.

The numbers (float32 inverse frequencies, attention scaling, per layer kind) come from the model's own
rotary-embedding class, instantiated on CPU from the config; the pair layout (half-split or interleaved) and the
rotary width are then checked against the model's own ``apply_rotary_pos_emb`` on random keys (the probe), so a
model whose rotation a spec cannot express is refused with :class:`~kvtc.errors.UnsupportedModel` instead of
being approximated. Building and probing cost a rotary module and a few small rotations: the adapter
(:mod:`kvtc.integrations.hf.adapter`) does it once per model config and keeps the spec.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers < 5
    from transformers import PretrainedConfig as PreTrainedConfig

from ...errors import UnsupportedModel
from ...rope import KNOWN_ROPE_TYPES, RopeKind, RopeSpec

#: relative error below which the spec is accepted as the model's own rotation when it is built.
PROBE_TOLERANCE = 1e-5


def rope_spec_from_config(config: Any) -> RopeSpec:
    """The rotation of the transformers model described by ``config`` (a ``PreTrainedConfig``), probed against
    the model's own (see the module docstring).

    Runs under float32 as the default dtype whatever the caller set (engines such as vLLM set bf16),
    because the model builds its frequencies in float32.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        return _spec_from_config(config)
    finally:
        torch.set_default_dtype(previous)


def _spec_from_config(config: Any) -> RopeSpec:
    text = text_config(config)
    head_dim = uniform_layer_attr(text, "head_dim") or (
        uniform_layer_attr(text, "hidden_size") // uniform_layer_attr(text, "num_attention_heads")
    )
    n_layers = int(text.num_hidden_layers)
    rotary = _rotary_module(text)
    kinds = _read_kinds(rotary, text)
    layer_kinds = _layer_kinds(text, kinds, n_layers)
    for kind in kinds:
        if kind.rotary_dim > head_dim:
            raise UnsupportedModel(
                f"{type(rotary).__name__} produces {kind.rotary_dim} rotary dims for {head_dim}-dim heads; "
                "kvtc cannot express this rotation"
            )
    candidates = [RopeSpec(head_dim, interleaved, kinds, layer_kinds) for interleaved in (False, True)]
    return _probe(rotary, candidates)


def text_config(config: Any) -> Any:
    """The decoder's text config of ``config``, refusing what kvtc cannot code (no decoder, MLA)."""
    if not isinstance(config, PreTrainedConfig):
        raise UnsupportedModel(f"expected a transformers config, got {type(config).__name__}")
    text = config.get_text_config(decoder=True)
    for field in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if getattr(text, field, None) is None:
            raise UnsupportedModel(f"{type(text).__name__} has no {field}; kvtc needs a decoder-only text model")
    if any(getattr(text, f, None) for f in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")):
        raise UnsupportedModel(
            f"{type(text).__name__} uses multi-head latent attention (MLA), whose rotated keys are a separate "
            "low-rank part; kvtc supports standard multi-head / grouped-query attention only"
        )
    return text


def uniform_layer_attr(text: Any, name: str) -> Any:
    """``text.<name>``, which must be the same for every layer (heterogeneous configs hold it per layer)."""
    if getattr(text, "is_heterogeneous", False):
        values = {getattr(c, name, None) for c in text.per_layer_config}
        if len(values) > 1:
            raise UnsupportedModel(
                f"{type(text).__name__} layers differ in {name} ({sorted(map(repr, values))}); kvtc needs one "
                "(KV heads, head_dim) shape and one RoPE width for every layer"
            )
        return values.pop() if values else None
    return getattr(text, name, None)


def _rotary_module(text: Any) -> torch.nn.Module:
    """A fresh CPU instance of the model's own rotary-embedding class, built from ``text``."""
    model_cls = None
    for mapping in ("MODEL_FOR_CAUSAL_LM_MAPPING", "MODEL_MAPPING"):
        try:
            model_cls = getattr(transformers, mapping)[type(text)]
            break
        except KeyError:
            continue
    if isinstance(model_cls, (list, tuple)):
        model_cls = model_cls[0]
    if model_cls is None:
        raise UnsupportedModel(
            f"transformers has no model class for {type(text).__name__}; kvtc cannot locate its rotary embedding"
        )
    module = importlib.import_module(model_cls.__module__)
    classes = [
        obj
        for name, obj in vars(module).items()
        if name.endswith("RotaryEmbedding")
        and isinstance(obj, type)
        and issubclass(obj, torch.nn.Module)
        and obj.__module__ == module.__name__
    ]
    if len(classes) != 1:
        # Several rotary classes (e.g. a vision tower's): ask a skeleton of the model which one its decoder uses.
        with torch.device("meta"):
            skeleton = model_cls(text)
        found = getattr(skeleton.get_decoder(), "rotary_emb", None)
        if found is None:
            raise UnsupportedModel(
                f"{model_cls.__name__} has no `rotary_emb` on its decoder; kvtc cannot locate its rotary embedding "
                "(models without RoPE or with a bespoke position encoding are not supported)"
            )
        classes = [type(found)]
    try:
        with torch.device("cpu"):
            return classes[0](text)
    except Exception as e:  # noqa: BLE001 - whatever stops it, this config's rotation cannot be read
        raise UnsupportedModel(f"could not build {classes[0].__name__} from the config ({e!r})") from None


def _read_kinds(rotary: torch.nn.Module, text: Any) -> tuple[RopeKind, ...]:
    rope_type = getattr(rotary, "rope_type", None)
    if isinstance(rope_type, dict):  # one rotation per layer type (Gemma 3: sliding vs full)
        per_type = {lt: (rt, f"{lt}_") for lt, rt in rope_type.items()}
    elif isinstance(rope_type, str):
        per_type = {"shared": (rope_type, "")}
    else:
        raise UnsupportedModel(f"{type(rotary).__name__} does not expose a rope_type; kvtc cannot read its rotation")
    kinds = []
    for name, (rt, prefix) in sorted(per_type.items()):
        if rt not in KNOWN_ROPE_TYPES:
            raise UnsupportedModel(
                f"rope type {rt!r} is not supported by this kvtc version (supported: {KNOWN_ROPE_TYPES})"
            )
        inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        scaling = getattr(rotary, f"{prefix}attention_scaling", None)
        if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or scaling is None:
            raise UnsupportedModel(
                f"{type(rotary).__name__} has no {prefix}inv_freq / {prefix}attention_scaling in the usual form; "
                "kvtc cannot read its rotation"
            )
        params = text.rope_parameters[name] if prefix else text.rope_parameters
        max_positions = long_freq = long_from = None
        if "dynamic" in rt:
            max_positions = int(text.max_position_embeddings)
        if rt == "longrope":
            long_from = int(params["original_max_position_embeddings"])
            kwargs = {"layer_type": name} if prefix else {}
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](text, torch.device("cpu"), seq_len=long_from + 1, **kwargs)
            long_freq = _floats(long)
        kinds.append(
            RopeKind(
                name=name,
                rope_type=rt,
                inv_freq=_floats(inv_freq),
                attention_scaling=float(scaling),
                max_positions=max_positions,
                long_inv_freq=long_freq,
                long_from=long_from,
            )
        )
    return tuple(kinds)


def _floats(t: torch.Tensor) -> tuple[float, ...]:
    return tuple(float(v) for v in t.detach().to("cpu", torch.float32).tolist())


def _layer_kinds(text: Any, kinds: tuple[RopeKind, ...], n_layers: int) -> tuple[str | None, ...]:
    names = {k.name for k in kinds}
    if names == {"shared"}:
        out: list[str | None] = ["shared"] * n_layers
    else:
        layer_types = getattr(text, "layer_types", None)
        if layer_types is None or len(layer_types) < n_layers:
            raise UnsupportedModel("per-layer-type RoPE without a layer_types list of one entry per layer")
        # A layer type whose rope parameters are None has no rotary entry: those layers use no RoPE.
        out = [lt if lt in names else None for lt in layer_types[:n_layers]]
    # SmolLM3 / Llama 4 convention: no_rope_layers[i] is truthy when layer i *uses* RoPE.
    use_rope = getattr(text, "no_rope_layers", None)
    if use_rope is not None:
        if len(use_rope) < n_layers:
            raise UnsupportedModel(f"no_rope_layers has {len(use_rope)} entries for {n_layers} layers")
        out = [k if use_rope[i] else None for i, k in enumerate(out)]
    rule = ROPE_ONLY_IN_SLIDING_LAYERS.get(getattr(text, "model_type", ""))
    if rule is not None:
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * n_layers
        windowed = getattr(text, "sliding_window", None) is not None
        for i in range(n_layers):
            sliding = windowed and layer_types[i] == "sliding_attention"
            if not (sliding or (rule == "unless-windowed" and not windowed)):
                out[i] = None
    return tuple(out)


#: Models whose attention rotates only in its sliding-window layers (the full-attention ones use no position
#: encoding), a rule of their attention code that no config field states, by the text config's ``model_type``:
#: ``"sliding-only"`` (Cohere 2: no sliding window, no RoPE anywhere), ``"unless-windowed"`` (EXAONE 4: every layer
#: rotates in a config without a sliding window). The adapter's check on a loaded model
#: (:func:`kvtc.integrations.hf.rotation.check_rotation`) refuses any other model whose layers disagree with its spec.
ROPE_ONLY_IN_SLIDING_LAYERS: dict[str, str] = {
    "cohere2": "sliding-only",
    "exaone4": "unless-windowed",
    "exaone_moe": "unless-windowed",
}


def _probe(rotary: torch.nn.Module, candidates: list[RopeSpec]) -> RopeSpec:
    """The candidate that reproduces the model's own cos/sin + ``apply_rotary_pos_emb`` on random keys."""
    module = importlib.import_module(type(rotary).__module__)
    model_apply = getattr(module, "apply_rotary_pos_emb", None)
    if model_apply is None:
        raise UnsupportedModel(
            f"{module.__name__} has no apply_rotary_pos_emb; kvtc cannot check how this model applies RoPE"
        )
    spec0 = candidates[0]
    gen = torch.Generator().manual_seed(0)
    errors: dict[bool, float] = {c.interleaved: 0.0 for c in candidates}
    for kind in spec0.kinds:
        layer = spec0.layer_kinds.index(kind.name) if kind.name in spec0.layer_kinds else None
        if layer is None:
            continue
        for positions in _probe_positions(kind):
            keys = torch.randn(1, 1, positions.numel(), spec0.head_dim, generator=gen)
            x = torch.zeros(1, positions.numel(), spec0.head_dim)
            pos = positions[None]
            wants = _model_rotations(rotary, model_apply, kind, keys, x, pos)
            ours_in = keys.permute(0, 2, 1, 3)[:, :, None]  # [1, tokens, 1 layer, 1 head, head_dim]
            for cand in candidates:
                got = cand.apply(ours_in, pos, [layer])[:, :, 0].permute(0, 2, 1, 3)
                err = min(float((got - w).abs().max() / w.abs().max().clamp_min(1e-30)) for w in wants)
                errors[cand.interleaved] = max(errors[cand.interleaved], err)
    for cand in candidates:
        if errors[cand.interleaved] <= PROBE_TOLERANCE:
            return cand
    raise UnsupportedModel(
        f"the rotation of {type(rotary).__name__} matches neither half-split nor interleaved pairs "
        f"(relative errors {errors}); kvtc cannot reproduce it exactly"
    )


def _model_rotations(
    rotary: torch.nn.Module, model_apply: Any, kind: RopeKind, keys: torch.Tensor, x: torch.Tensor, pos: torch.Tensor
) -> list[torch.Tensor]:
    """``keys`` (``[1, 1, tokens, head_dim]``) rotated by the model's own cos / sin and ``apply_rotary_pos_emb``,
    once per call convention that runs (the caller keeps whichever matches).

    Partial-rotary models either hand the whole head to ``apply_rotary_pos_emb`` (GPT-NeoX, GLM) or split off the
    rotary part in the attention layer first (StableLM, Phi); most functions take ``(q, k, cos, sin)``, a few
    ``(x, cos, sin)``.
    """
    try:
        cos, sin = rotary(x, pos, kind.name) if kind.name != "shared" else rotary(x, pos)
    except Exception as e:  # noqa: BLE001 - any failure means the model's rope is not the usual kind
        raise UnsupportedModel(
            f"could not evaluate {type(rotary).__name__} the usual way ({e!r}); "
            "kvtc supports the standard transformers RoPE call convention only"
        ) from None
    calls = (
        lambda k: model_apply(k, k, cos, sin)[1],  # apply_rotary_pos_emb(q, k, cos, sin) -> (q, k)
        lambda k: model_apply(k, cos, sin),  # apply_rotary_pos_emb(x, cos, sin) -> x (Gemma 3n)
    )
    outputs, failures = [], []
    for width in dict.fromkeys((keys.shape[-1], kind.rotary_dim)):
        for call in calls:
            try:
                out = call(keys[..., :width])
            except Exception as e:  # noqa: BLE001
                failures.append(repr(e))
                continue
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (*keys.shape[:-1], width):
                outputs.append(torch.cat((out, keys[..., width:]), dim=-1))
            else:
                failures.append(f"unexpected result {type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
    if outputs:
        return outputs
    raise UnsupportedModel(
        f"could not evaluate apply_rotary_pos_emb of {type(rotary).__module__} the usual way ({'; '.join(failures)}); "
        "kvtc supports the standard transformers RoPE call convention only"
    )


def _probe_positions(kind: RopeKind) -> list[torch.Tensor]:
    """Positions to compare the model's rotation with ours, staying in each regime of the rope type."""
    spread = [0, 1, 2, 3, 5, 8, 13, 31, 100, 257, 1000, 4099, 16411, 65537]
    if kind.max_positions is not None:
        return [torch.tensor([p for p in spread if p < kind.max_positions] + [kind.max_positions - 1])]
    if kind.long_from is not None:
        short = [p for p in spread if p < kind.long_from - 1] + [kind.long_from - 1]
        return [torch.tensor(short), torch.tensor(short + [kind.long_from + 7])]
    return [torch.tensor(spread)]
