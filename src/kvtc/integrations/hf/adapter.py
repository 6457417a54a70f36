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

What kvtc needs to know about a model (its layout, its :class:`~kvtc.rope.RopeSpec`, which layers are recurrent)
is read once per model config into a :class:`ModelAdapter` (:func:`adapter_for` keeps it for as long as the config
lives, and reads it again if the config is changed in place), so describing, extracting, rebuilding and checking
a calibration never rebuild or re-probe the model's rotary embedding. Everything the adapter returns is a plain
:class:`~kvtc.layout.KVSlice` / :class:`~kvtc.layout.KVLayout`.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import weakref
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

from ...calibration.artifact import Calibration
from ...errors import LayoutError, UnsupportedModel
from ...layout import KVLayout, KVSlice, dtype_name
from ...rope import RopeSpec
from .rope_probe import PreTrainedConfig, rope_spec_from_config, text_config, uniform_layer_attr
from .rotation import check_rotation

#: dtype recorded for a layout described from a config alone (the usual serving dtype).
DEFAULT_CONFIG_DTYPE = "bfloat16"


class ModelAdapter:
    """What kvtc reads from one transformers model config, read once; get it with :func:`adapter_for`.

    ``layout``: the KV layout (real indices of the layers that carry KV, KV heads, head_dim), with dtype
    :data:`DEFAULT_CONFIG_DTYPE` (:meth:`layout_for` gives a model's). ``rope``: the model's rotation, read from
    its own rotary-embedding class and probed against its own rotation (:mod:`.rope_probe`). ``hybrid``: whether
    some layers keep a recurrent state instead of KV (linear attention, SSM). The adapter holds its config weakly.
    """

    #: adapters built in this process so far; each built and probed its model's rotary embedding once
    builds: ClassVar[int] = 0

    def __init__(self, config: PreTrainedConfig) -> None:
        self.rope: RopeSpec = rope_spec_from_config(config)
        heads = _kv_heads(text_config(config), self.rope.head_dim)
        layers, limits, self.hybrid = _cache_layers(config)
        self.layout = KVLayout(
            layers=layers,
            num_kv_heads=heads,
            head_dim=self.rope.head_dim,
            dtype=DEFAULT_CONFIG_DTYPE,
            max_tokens=limits,
        )
        self.name = str(getattr(config, "name_or_path", "") or "")
        self._config = weakref.ref(config)
        ModelAdapter.builds += 1

    @property
    def config(self) -> PreTrainedConfig:
        config = self._config()
        if config is None:
            raise UnsupportedModel(
                "the model config this adapter was read from no longer exists; use adapter_for(model)"
            )
        return config

    def layout_for(self, model: PreTrainedModel | None = None) -> KVLayout:
        """:attr:`layout` with ``model``'s parameter dtype (``None``: the config's default, bfloat16)."""
        if model is None:
            return self.layout
        self._own(model)
        return dataclasses.replace(self.layout, dtype=dtype_name(model.dtype))

    def check_layout(self, layout: KVLayout, what: str = "the slice") -> None:
        """Refuse KV of another model (layers, KV heads, head_dim) or of only some heads (a tensor-parallel shard)."""
        if layout.model_shape != self.layout.model_shape or layout.heads != tuple(range(layout.num_kv_heads)):
            raise LayoutError(
                f"{what}'s layout ({_shape(layout)}) is not this model's ({_shape(self.layout)}); use it with the "
                "model that made it, holding every KV head (merge tensor-parallel shards first)"
            )

    def check(self, calibration: Calibration) -> None:
        """Refuse a calibration made for another model (layout or RoPE differ): :meth:`Calibration.check_model`."""
        calibration.check_model(self.layout, self.rope, model=f"model {self.name or 'given'}")

    def extract(
        self, cache: Cache, positions: torch.Tensor | None = None, model_id: str = "", *, every_token: bool = False
    ) -> KVSlice:
        """Read every KV-carrying layer of ``cache`` into a :class:`KVSlice` with pre-RoPE keys
        (see :func:`extract_slice`). ``every_token``: keep every token of every layer (a cache built without config
        holds them), in a layout without ``max_tokens``: calibration rows, not a slice to store."""
        layout = dataclasses.replace(self.layout, max_tokens=()) if every_token else self.layout
        if not isinstance(cache, Cache):
            raise LayoutError(f"expected a transformers Cache, got {type(cache).__name__}")
        if len(cache.layers) <= layout.layers[-1]:
            raise LayoutError(
                f"the cache has {len(cache.layers)} layers but the model's KV layers go up to {layout.layers[-1]}; "
                "fill it with this model first"
            )
        keys, values, seen = [], [], []
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
            sliding = isinstance(layer, DynamicSlidingWindowLayer)
            seen.append(int(getattr(layer, "cumulative_length", held)) if sliding else held)
            keys.append(k)
            values.append(v)
        tokens = max(seen)
        batches = {int(k.shape[0]) for k in keys}
        if len(batches) != 1:
            raise LayoutError(f"KV layers disagree on batch size {sorted(batches)}")
        batch = batches.pop()
        shape = (batch, tokens, len(layout.layers), layout.num_kv_heads, layout.head_dim)
        # every layer for every token; a sliding-window layer fills only the newest tokens it holds (the rest is 0)
        key_t = keys[0].new_zeros(shape) if layout.max_tokens else keys[0].new_empty(shape)
        value_t = torch.zeros_like(key_t) if layout.max_tokens else torch.empty_like(key_t)
        for i, li in enumerate(layout.layers):
            n = layout.held(i, tokens)
            have = int(keys[i].shape[2])
            if have < n or seen[i] != tokens:
                raise LayoutError(
                    f"cache layer {li} has seen {seen[i]} tokens and holds {have}, but the sequence has {tokens} "
                    f"tokens and this layer keeps {n} of them; the cache's layers disagree (was it filled by this "
                    "model, or cropped?)"
                )
            key_t[:, tokens - n :, i] = keys[i][:, :, have - n :].transpose(1, 2)
            value_t[:, tokens - n :, i] = values[i][:, :, have - n :].transpose(1, 2)
        if positions is None:
            positions = torch.arange(tokens, device=key_t.device).expand(batch, tokens).contiguous()
        elif not isinstance(positions, torch.Tensor):
            raise LayoutError(f"positions must be an int64 tensor [batch, tokens], got {type(positions).__name__}")
        positions = positions.to(key_t.device)
        pre = self.rope.invert(key_t, positions, layout.layers)
        layout = dataclasses.replace(layout, dtype=dtype_name(key_t.dtype))
        return KVSlice(layout=layout, keys=pre, values=value_t, positions=positions, model_id=model_id)

    def rebuild(
        self, kv: KVSlice, model: PreTrainedModel | None = None, *, linear_states: Cache | None = None
    ) -> DynamicCache:
        """A fresh ``DynamicCache(config=...)`` holding ``kv`` with RoPE re-applied, in ``model``'s dtype and on its
        device (the slice's without a model; see :func:`rebuild_cache`)."""
        got = kv.layout
        self.check_layout(got)
        kv.validate()
        if model is not None:
            self._own(model)
        dtype = model.dtype if model is not None else got.torch_dtype
        device = model.device if model is not None else kv.keys.device
        # [layers, batch, heads, tokens, head_dim]: each layer's [B, H, T, D] contiguous (one fused pass on CUDA)
        keys = self.rope.apply_to_heads(kv.keys.to(device), kv.positions, got.layers, dtype)
        values = kv.values.to(device=device, dtype=dtype).permute(2, 0, 3, 1, 4).contiguous()
        # the cache must own its tensors: a later in-place write into it must not reach the caller's slice
        keys = keys.clone() if _shares_storage(keys, kv.keys) else keys
        values = values.clone() if _shares_storage(values, kv.values) else values

        cache = DynamicCache(config=self.config)
        if linear_states is not None:
            _copy_linear_states(linear_states, cache)
        tokens = kv.num_tokens
        for i, li in enumerate(got.layers):
            n = got.held(i, tokens)
            _put(cache, li, keys[i][:, :, tokens - n :], values[i][:, :, tokens - n :], tokens)
        return cache

    def rebuild_layers(
        self,
        layers: Iterable[tuple[int, torch.Tensor, torch.Tensor]],
        positions: torch.Tensor,
        model: PreTrainedModel | None = None,
    ) -> DynamicCache:
        """:meth:`rebuild` from layers handed over one at a time (``(real layer index, keys, values)``, each
        ``[batch, tokens, heads, head_dim]`` with pre-RoPE keys, as :meth:`~kvtc.codec.Codec.decode_layers`
        yields them): each layer is rotated and stored as it arrives, so a GPU decoder can still be computing
        later layers while earlier ones are placed. ``positions``: int64 ``[batch, tokens]``. Every KV layer of
        the layout must come, once."""
        if model is not None:
            self._own(model)
        lay = self.layout
        cache = DynamicCache(config=self.config)
        seen = []
        pos, tables = None, None
        if model is not None:  # the RoPE tables, before the first layer is asked for (their making syncs the device)
            pos = positions.to(model.device)
            tables = self.rope.head_tables(pos, lay.layers) if pos.is_cuda else None
        for li, k, v in layers:
            if li not in lay.layers or li in seen or k.dim() != 4 or k.shape != v.shape:
                raise LayoutError(f"layer {li} with keys {tuple(k.shape)} does not fit {_shape(lay)} (or came twice)")
            seen.append(li)
            dtype = model.dtype if model is not None else k.dtype
            device = model.device if model is not None else k.device
            if pos is None or pos.device != device:
                pos = positions.to(device)
                tables = self.rope.head_tables(pos, lay.layers) if pos.is_cuda else None
            keys = self.rope.apply_to_heads(k.unsqueeze(2).to(device), pos, (li,), dtype, tables)[0]
            values = v.to(device=device, dtype=dtype).transpose(1, 2).contiguous()
            keys = keys.clone() if _shares_storage(keys, k) else keys
            values = values.clone() if _shares_storage(values, v) else values
            tokens = int(k.shape[1])
            n = lay.held(lay.layers.index(li), tokens)  # a sliding-window layer keeps its newest tokens
            _put(cache, li, keys[:, :, tokens - n :], values[:, :, tokens - n :], tokens)
        if sorted(seen) != sorted(lay.layers):
            raise LayoutError(f"got layers {sorted(seen)}, the model's KV layers are {list(lay.layers)}")
        return cache

    def _own(self, model: PreTrainedModel) -> None:
        if model.config is not self._config():
            raise UnsupportedModel("this adapter was read from another model's config; use adapter_for(model)")


_ADAPTERS: dict[int, tuple[weakref.ref[Any], dict[str, Any], ModelAdapter]] = {}
_LOCK = threading.RLock()  # re-entrant: a config collected while an adapter is built is forgotten under it


def adapter_for(model_or_config: PreTrainedModel | PreTrainedConfig) -> ModelAdapter:
    """The :class:`ModelAdapter` of a model (or of its config), built on first use and kept while the config lives.

    A config changed in place since (another RoPE, another layer count) gets a new adapter. Given a model, also
    refuses one whose rotary frequencies were cast below float32 after loading (it no longer rotates as its
    config says). Raises :class:`~kvtc.errors.UnsupportedModel` for attention kvtc cannot code: multi-head latent
    attention, layers whose head_dim or KV head count differ, sparse-indexer or custom cache layers.
    """
    config, model = _config_and_model(model_or_config)
    if model is not None:
        _check_rotary_buffers(model)
    key = id(config)
    with _LOCK:
        entry = _ADAPTERS.get(key)
        if entry is not None and entry[0]() is config and entry[1] == config.__dict__:
            adapter = entry[2]
        else:
            adapter = ModelAdapter(config)
            ref = weakref.ref(config, lambda r, key=key: _forget(key, r))
            _ADAPTERS[key] = (ref, copy.deepcopy(config.__dict__), adapter)
    if model is not None:
        check_rotation(model, adapter)
    return adapter


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    with _LOCK:
        entry = _ADAPTERS.get(key)
        if entry is not None and entry[0] is ref:
            del _ADAPTERS[key]


def describe_model(model_or_config: PreTrainedModel | PreTrainedConfig) -> tuple[KVLayout, RopeSpec]:
    """The KV layout (real indices of the layers that carry KV, KV heads, head_dim, dtype) and the RoPE of a model.

    ``dtype`` is the model's parameter dtype when a model is given, ``"bfloat16"`` for a bare config.
    Raises :class:`~kvtc.errors.UnsupportedModel` for attention kvtc cannot code (see :func:`adapter_for`).
    """
    adapter = adapter_for(model_or_config)
    return adapter.layout_for(_config_and_model(model_or_config)[1]), adapter.rope


def extract_slice(
    cache: Cache,
    model_or_config: PreTrainedModel | PreTrainedConfig,
    positions: torch.Tensor | None = None,
    model_id: str = "",
    *,
    every_token: bool = False,
) -> KVSlice:
    """Read every KV-carrying layer of ``cache`` into a :class:`KVSlice` with pre-RoPE keys.

    ``cache``: a ``DynamicCache`` the model has filled (any batch size); each KV layer holds
    ``[batch, kv_heads, tokens, head_dim]``.
    ``positions``: int64 ``[batch, tokens]`` absolute positions of the cached tokens; default ``arange(tokens)`` for
    every row (right for unpadded sequences; pass the real positions for left-padded batches).
    Returns keys / values ``[batch, tokens, len(layers), kv_heads, head_dim]`` in the cache's dtype, on its device.

    A sliding-window layer holds only its newest ``sliding_window - 1`` tokens once the sequence is longer (the
    layout's ``max_tokens``): the slice holds those, with zeros before them, and a codec stores only those. A cache
    built without ``config`` (every layer keeping every token) gives the same slice: the older tokens of a sliding
    layer are dropped, as the model's own cache would. ``every_token=True`` keeps them (from such a cache) in a
    layout without ``max_tokens``: what calibration samples, not what a model's cache holds.
    """
    return adapter_for(model_or_config).extract(cache, positions, model_id, every_token=every_token)


def rebuild_cache(
    kv: KVSlice, model_or_config: PreTrainedModel | PreTrainedConfig, *, linear_states: Cache | None = None
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
    adapter = adapter_for(model_or_config)
    return adapter.rebuild(kv, _config_and_model(model_or_config)[1], linear_states=linear_states)


def rebuild_cache_from_layers(
    layers: Iterable[tuple[int, torch.Tensor, torch.Tensor]],
    positions: torch.Tensor,
    model_or_config: PreTrainedModel | PreTrainedConfig,
) -> DynamicCache:
    """:func:`rebuild_cache` from layers handed over one at a time, e.g. ``codec.decode_layers(blob,
    device="cuda")``: see :meth:`ModelAdapter.rebuild_layers` (dense models; hybrid models use
    :func:`rebuild_cache`)."""
    adapter = adapter_for(model_or_config)
    return adapter.rebuild_layers(layers, positions, _config_and_model(model_or_config)[1])


def check_model(calibration: Calibration, model: PreTrainedModel | PreTrainedConfig) -> None:
    """Refuse a calibration made for another model (layout or RoPE differ):
    :meth:`~kvtc.calibration.artifact.Calibration.check_model` with the model's layout and RoPE."""
    adapter_for(model).check(calibration)


def is_hybrid(model_or_config: PreTrainedModel | PreTrainedConfig) -> bool:
    """True when the model has layers that keep a recurrent state instead of KV (linear attention, SSM)."""
    return adapter_for(model_or_config).hybrid


# ---------------------------------------------------------------------- helpers


def _shape(layout: KVLayout) -> str:
    n = len(layout.layers)
    layers = list(layout.layers) if n <= 6 else f"[{layout.layers[0]}, ..., {layout.layers[-1]}] ({n})"
    heads = "" if len(layout.heads) == layout.num_kv_heads else f" (holding {list(layout.heads)})"
    windows = sorted({x for x in layout.max_tokens if x})
    held = f", sliding layers holding {windows} tokens" if windows else ""
    return f"layers {layers}, {layout.num_kv_heads} KV heads{heads} of {layout.head_dim}{held}"


def _put(cache: DynamicCache, li: int, keys: torch.Tensor, values: torch.Tensor, tokens: int) -> None:
    """Store one layer's ``[B, H, n, D]`` keys (RoPE applied) and values, the newest ``n`` of a ``tokens``-long
    sequence, into a fresh cache."""
    layer = cache.layers[li] if li < len(cache.layers) else None
    if type(layer) is DynamicLayer and not layer.is_initialized:
        # what update() would store, without its concatenation onto an empty tensor (a full extra copy)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    else:  # sliding-window, hybrid and other layers keep their own update logic (trimming, states)
        cache.update(keys, values, li)
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = tokens  # it has seen the whole sequence, holds its newest n tokens


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


def _cache_layers(config: Any) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """Real indices of the layers whose cache entry holds attention KV, the most tokens each holds (0: all; a
    sliding-window layer keeps its newest ``sliding_window - 1``), and whether some layers keep a recurrent state."""
    try:
        cache = DynamicCache(config=config)
    except KeyError as e:
        raise UnsupportedModel(
            f"transformers has no cache layer for layer type {e}; kvtc cannot read this model"
        ) from None
    layers, limits, hybrid = [], [], False
    for i, layer in enumerate(cache.layers):
        recurrent = isinstance(layer, LinearAttentionCacheLayerMixin)
        hybrid |= recurrent
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) or (isinstance(layer, DynamicLayer) and recurrent):
            layers.append(i)
            sliding = isinstance(layer, DynamicSlidingWindowLayer)
            limits.append(max(int(layer.sliding_window) - 1, 1) if sliding else 0)
        elif not recurrent:  # a recurrent-only layer (linear attention, SSM, conv, no attention) is skipped
            raise UnsupportedModel(
                f"layer {i} uses cache layer {type(layer).__name__}, which kvtc cannot read "
                "(sparse-indexer or compressed attention); only dense full / sliding attention is supported"
            )
    if not layers:
        raise UnsupportedModel(f"{type(config).__name__} has no layer with attention KV; there is nothing to code")
    return tuple(layers), tuple(limits), hybrid


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
