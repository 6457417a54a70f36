"""Hugging Face transformers adapter: a model's KV layout and RoPE, and ``DynamicCache`` <-> :class:`KVSlice`.

Written against the transformers 5.x cache API. A ``DynamicCache(config=...)`` holds one layer object per entry of
``config.layer_types``:

* ``DynamicLayer`` (full attention) and ``DynamicSlidingWindowLayer`` (sliding / chunked attention) carry keys and
  values as ``[batch, kv_heads, seq, head_dim]``, keys post-RoPE. Hybrid layers that carry both an attention KV and a
  recurrent state subclass ``DynamicLayer`` too; their KV is taken like any other.
* Linear-attention / SSM / conv layers (``LinearAttentionLayer``) carry a fixed-size recurrent state and no KV: they
  are skipped, and layers are named by their *real* index (a model whose layers 3 and 7 attend gives
  ``layout.layers == (3, 7)``).
* Layers that share another layer's KV (``num_kv_shared_layers``) have no cache entry at all and are skipped.

Only these functions know about transformers; everything they return is a plain :class:`~kvtc.layout.KVSlice`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers < 5
    from transformers import PretrainedConfig as PreTrainedConfig

from ..errors import LayoutError, UnsupportedModel
from ..layout import KVLayout, KVSlice, dtype_name
from ..rope import RopeSpec, uniform_layer_attr

#: dtype recorded for a layout described from a config alone (the usual serving dtype).
DEFAULT_CONFIG_DTYPE = "bfloat16"


def describe_model(model_or_config: PreTrainedModel | PreTrainedConfig) -> tuple[KVLayout, RopeSpec]:
    """The KV layout (real indices of the layers that carry KV, KV heads, head_dim, dtype) and the RoPE of a model.

    ``dtype`` is the model's parameter dtype when a model is given, ``"bfloat16"`` for a bare config.
    Raises :class:`~kvtc.errors.UnsupportedModel` for attention kvtc cannot code: multi-head latent attention,
    layers whose head_dim or KV head count differ, sparse-indexer or custom cache layers, and a model whose rotary
    frequencies were cast below float32 after loading (it no longer rotates as its config says).
    """
    config, model = _config_and_model(model_or_config)
    if model is not None:
        _check_rotary_buffers(model)
    spec = RopeSpec.from_hf_config(config)
    heads = _kv_heads(config.get_text_config(decoder=True), spec.head_dim)
    dtype = dtype_name(model.dtype) if model is not None else DEFAULT_CONFIG_DTYPE
    layout = KVLayout(layers=_kv_layers(config), num_kv_heads=heads, head_dim=spec.head_dim, dtype=dtype)
    return layout, spec


def extract_slice(
    cache: Cache,
    model_or_config: PreTrainedModel | PreTrainedConfig,
    positions: torch.Tensor | None = None,
    model_id: str = "",
) -> KVSlice:
    """Read every KV-carrying layer of ``cache`` into a :class:`KVSlice` with pre-RoPE keys.

    ``cache``: a ``DynamicCache`` the model has filled (any batch size); each KV layer holds
    ``[batch, kv_heads, tokens, head_dim]``.
    ``positions``: int64 ``[batch, tokens]`` absolute positions of the cached tokens; default ``arange(tokens)`` for
    every row (right for unpadded sequences; pass the real positions for left-padded batches).
    Returns keys / values ``[batch, tokens, len(layers), kv_heads, head_dim]`` in the cache's dtype, on its device.

    Sliding-window layers keep only their last ``sliding_window - 1`` tokens once the sequence is longer, while a
    slice holds the same tokens for every layer: such a cache raises :class:`~kvtc.errors.LayoutError`. Extract
    before the window fills, or run the model with a ``DynamicCache()`` built without ``config`` (every layer then
    keeps all tokens; the model still masks to the window).
    """
    layout, spec = describe_model(model_or_config)
    if not isinstance(cache, Cache):
        raise LayoutError(f"expected a transformers Cache, got {type(cache).__name__}")
    if len(cache.layers) <= layout.layers[-1]:
        raise LayoutError(
            f"the cache has {len(cache.layers)} layers but the model's KV layers go up to {layout.layers[-1]}; "
            "fill it with this model first"
        )
    keys, values = [], []
    for li in layout.layers:
        layer = cache.layers[li]
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.numel() == 0:
            raise LayoutError(f"cache layer {li} holds no keys; run the model with this cache before extracting")
        want = (layout.num_kv_heads, layout.head_dim)
        if k.dim() != 4 or (k.shape[1], k.shape[3]) != want or k.shape != v.shape:
            raise UnsupportedModel(
                f"cache layer {li} holds keys {tuple(k.shape)} / values {tuple(v.shape)}, expected "
                f"[batch, {want[0]}, tokens, {want[1]}] for both; this model's attention is not plain MHA/GQA"
            )
        held = int(k.shape[2])
        seen = int(getattr(layer, "cumulative_length", held)) if isinstance(layer, DynamicSlidingWindowLayer) else held
        if seen != held:
            raise LayoutError(
                f"sliding-window layer {li} keeps only the last {held} of {seen} tokens, so the cache no longer "
                "holds the whole sequence; extract before the window fills or run the model with a DynamicCache() "
                "built without config (every layer then keeps all tokens)"
            )
        keys.append(k.transpose(1, 2))
        values.append(v.transpose(1, 2))
    lengths = {int(k.shape[1]) for k in keys}
    batches = {int(k.shape[0]) for k in keys}
    if len(lengths) != 1 or len(batches) != 1:
        raise LayoutError(f"KV layers disagree on batch {sorted(batches)} / tokens {sorted(lengths)}")
    key_t = torch.stack(keys, dim=2)  # [batch, tokens, layers, heads, head_dim]
    value_t = torch.stack(values, dim=2)
    batch, tokens = int(key_t.shape[0]), int(key_t.shape[1])
    if positions is None:
        positions = torch.arange(tokens, device=key_t.device).expand(batch, tokens).contiguous()
    elif not isinstance(positions, torch.Tensor):
        raise LayoutError(f"positions must be an int64 tensor [batch, tokens], got {type(positions).__name__}")
    positions = positions.to(key_t.device)
    pre = spec.invert(key_t, positions, layout.layers)
    layout = dataclasses.replace(layout, dtype=dtype_name(key_t.dtype))
    return KVSlice(layout=layout, keys=pre, values=value_t, positions=positions, model_id=model_id)


def rebuild_cache(
    kv: KVSlice,
    model_or_config: PreTrainedModel | PreTrainedConfig,
    *,
    linear_states: Cache | None = None,
) -> DynamicCache:
    """A fresh ``DynamicCache(config=...)`` holding ``kv`` with RoPE re-applied, ready for ``model(...)`` or
    ``model.generate(...)`` as ``past_key_values``.

    Tensors are cast to the model's dtype and moved to its device when a model is given (to the slice's dtype and
    device for a bare config). Sliding-window layers trim to their window exactly as if the model had written them.
    Linear-attention layers have no KV: they stay empty unless ``linear_states`` (a cache of the same model and
    batch, e.g. the one the slice was extracted from) is given, whose recurrent / conv states are then copied. A
    hybrid model continues correctly only with those states: an empty recurrent state means "no history".
    The slice must hold every KV head (merge tensor-parallel shards first).
    """
    config, model = _config_and_model(model_or_config)
    layout, spec = describe_model(config)
    got = kv.layout
    if got.model_shape != layout.model_shape:
        raise LayoutError(
            f"the slice's layout (layers {got.layers}, {got.num_kv_heads} KV heads of {got.head_dim}) is not this "
            f"model's (layers {layout.layers}, {layout.num_kv_heads} KV heads of {layout.head_dim})"
        )
    if got.heads != tuple(range(got.num_kv_heads)):
        raise LayoutError(f"the slice holds KV heads {got.heads} only; merge the shards into all heads first")
    kv.validate()
    dtype = model.dtype if model is not None else got.torch_dtype
    device = model.device if model is not None else kv.keys.device
    # [layers, batch, heads, tokens, head_dim]: each layer's [B, H, T, D] contiguous (one fused pass on CUDA)
    keys = spec.apply_to_heads(kv.keys.to(device), kv.positions, got.layers, dtype)
    values = kv.values.to(device=device, dtype=dtype).permute(2, 0, 3, 1, 4).contiguous()
    # the cache must own its tensors: a later in-place write into it must not reach the caller's slice
    keys = keys.clone() if _shares_storage(keys, kv.keys) else keys
    values = values.clone() if _shares_storage(values, kv.values) else values

    cache = DynamicCache(config=config)
    if linear_states is not None:
        _copy_linear_states(linear_states, cache)
    for i, li in enumerate(got.layers):
        layer = cache.layers[li] if li < len(cache.layers) else None
        if type(layer) is DynamicLayer and not layer.is_initialized:
            # what update() would store, without its concatenation onto an empty tensor (a full extra copy)
            layer.lazy_initialization(keys[i], values[i])
            layer.keys, layer.values = keys[i], values[i]
        else:  # sliding-window, hybrid and other layers keep their own update logic (trimming, states)
            cache.update(keys[i], values[i], li)
    return cache


# ---------------------------------------------------------------------- helpers


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _config_and_model(obj: Any) -> tuple[Any, PreTrainedModel | None]:
    if isinstance(obj, PreTrainedModel):
        return obj.config, obj
    if isinstance(obj, PreTrainedConfig):
        return obj, None
    raise UnsupportedModel(f"expected a transformers model or config, got {type(obj).__name__}")


def _check_rotary_buffers(model: PreTrainedModel) -> None:
    """Refuse a model whose rotary frequencies were cast below float32 (``model.to(torch.bfloat16)``, ``.half()``):
    it then rotates with rounded frequencies, not the ones its config (and so the RopeSpec) defines."""
    for name, buf in model.get_decoder().named_buffers():
        if name.endswith("inv_freq") and buf.dtype != torch.float32:
            raise UnsupportedModel(
                f"the model's rotary frequencies {name} are {buf.dtype}, not float32 (the model was cast with "
                ".to(dtype) / .half() after loading), so it no longer rotates as its config defines; load it with "
                "from_pretrained(..., dtype=...) or from_config(..., dtype=...), which keep them float32"
            )


def _kv_heads(text: Any, head_dim: int) -> int:
    """KV heads per layer, refusing models whose layers differ in KV shape."""
    heads = uniform_layer_attr(text, "num_key_value_heads") or uniform_layer_attr(text, "num_attention_heads")
    for field, value in (("global_head_dim", head_dim), ("num_global_key_value_heads", heads)):
        other = getattr(text, field, None)
        if other is not None and other != value:
            raise UnsupportedModel(
                f"{type(text).__name__} has {field}={other} != {value}: its layers differ in KV shape, and a kvtc "
                "layout needs one (KV heads, head_dim) for every layer"
            )
    return int(heads)


def _kv_layers(config: Any) -> tuple[int, ...]:
    """Real indices of the layers whose cache entry holds attention KV."""
    try:
        cache = DynamicCache(config=config)
    except KeyError as e:
        raise UnsupportedModel(
            f"transformers has no cache layer for layer type {e}; kvtc cannot read this model"
        ) from None
    layers = []
    for i, layer in enumerate(cache.layers):
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) or (
            isinstance(layer, DynamicLayer) and isinstance(layer, LinearAttentionCacheLayerMixin)
        ):
            layers.append(i)
        elif isinstance(layer, LinearAttentionCacheLayerMixin):
            continue  # recurrent state only (linear attention, SSM, conv, or a layer without attention)
        else:
            raise UnsupportedModel(
                f"layer {i} uses cache layer {type(layer).__name__}, which kvtc cannot read "
                "(sparse-indexer or compressed attention); only dense full / sliding attention is supported"
            )
    if not layers:
        raise UnsupportedModel(f"{type(config).__name__} has no layer with attention KV; there is nothing to code")
    return tuple(layers)


def _copy_linear_states(source: Cache, target: DynamicCache) -> None:
    if not isinstance(source, Cache) or len(source.layers) != len(target.layers):
        raise LayoutError("linear_states must be a cache of the same model (same number of layers)")
    for i, layer in enumerate(source.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        if type(layer) is not type(target.layers[i]):
            raise LayoutError(
                f"linear_states layer {i} is a {type(layer).__name__}, "
                f"this model's is {type(target.layers[i]).__name__}"
            )
        state = copy.deepcopy(layer)
        if isinstance(state, DynamicLayer):  # hybrid layer: keep the recurrent part, the KV comes from the slice
            DynamicLayer.reset(state)
        target.layers[i] = state
