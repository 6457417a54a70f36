"""Exact rotary position embedding (RoPE) of a model, as a self-contained, serialisable :class:`RopeSpec`.

kvtc codes keys *pre-RoPE* (ALGORITHM.md, step 2): the adapter undoes the model's rotation after reading a cache
and re-applies it before handing the cache back. Both directions must be the model's own rotation, bit for bit
where possible, so the spec stores the *numbers* the model computes (its float32 inverse frequencies and
attention scaling, per layer kind) rather than the recipe (theta, scaling type), and it is built by asking the
model's own rotary-embedding class for them. Equal specs rotate identically; a calibration records the spec's
:meth:`RopeSpec.fingerprint` and refuses keys produced under another one.

Conventions (``r = rotary_dim = 2 * len(inv_freq)``):

* Only the first ``r`` elements of ``head_dim`` rotate (``partial_rotary_factor``); the rest pass through.
* ``interleaved=False`` (Llama, "rotate_half"): element ``i`` pairs with ``i + r/2``.
  ``interleaved=True`` (GLM, Cohere): element ``2i`` pairs with ``2i + 1``.
* Pair ``i`` at position ``p`` turns by ``θ = float32(p) * inv_freq[i]``, computed in float32 exactly as the model
  does (the angle is the model's, even where float32 rounding makes it differ from the real-number one).
* Models whose rope type scales cos and sin (yarn, longrope) multiply the rotated part by ``attention_scaling``;
  :meth:`RopeSpec.invert` divides it back out.

Sequence-length-dependent rope types, and what the spec does about them:

* ``dynamic`` (NTK): the model recomputes its frequencies once a forward pass reaches past
  ``max_position_embeddings``, and what it then uses depends on the history of that rotary module. The spec is
  exact for positions below ``max_position_embeddings`` (where the frequencies are the original ones) and raises
  :class:`~kvtc.errors.UnsupportedModel` for any position at or beyond it.
* ``longrope``: the model uses its short factors when the largest position of a forward pass is below
  ``original_max_position_embeddings`` and its long factors otherwise. The spec records both and chooses the same
  way from the largest position it is given. This reproduces a cache filled by forward passes that all fell on one
  side of that boundary; a cache that crossed it during decoding holds keys rotated both ways (the model's own
  inconsistency) and cannot be inverted exactly by anyone.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import FormatError, LayoutError, UnsupportedModel

#: version of the dictionary written by :meth:`RopeSpec.to_dict`.
SPEC_VERSION = 1

#: rope types whose frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")
#: every rope type this version knows how to reproduce.
KNOWN_ROPE_TYPES = (*STATIC_ROPE_TYPES, "dynamic", "longrope")

#: relative error below which the spec is accepted as the model's own rotation when it is built.
PROBE_TOLERANCE = 1e-5


@dataclass(frozen=True)
class RopeKind:
    """One rotation, shared by a group of layers (e.g. all of Gemma 3's sliding-window layers).

    ``name``: the layer type it belongs to (``"sliding_attention"``...) or ``"shared"`` when every layer rotates alike.
    ``rope_type``: the model's rope type (``"default"``, ``"yarn"``...), which decides the two fields below.
    ``inv_freq``: the model's float32 inverse frequencies, one per rotated pair.
    ``attention_scaling``: factor the model multiplies cos and sin by (1.0 unless yarn / longrope).
    ``max_positions``: ``dynamic`` only: positions must stay below it (see the module docstring).
    ``long_inv_freq`` / ``long_from``: ``longrope`` only: frequencies used when the largest position is
    ``>= long_from``.
    """

    name: str
    rope_type: str
    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    max_positions: int | None = None
    long_inv_freq: tuple[float, ...] | None = None
    long_from: int | None = None

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    def frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        """The float32 inverse frequencies the model uses for a forward pass over ``positions``."""
        if positions.numel() == 0:
            top = -1
        else:
            top = int(positions.max())
            if int(positions.min()) < 0:
                raise LayoutError(f"positions must be non-negative, got {int(positions.min())}")
        if self.max_positions is not None and top >= self.max_positions:
            raise UnsupportedModel(
                f"rope type {self.rope_type!r} of {self.name!r} layers changes its frequencies past position "
                f"{self.max_positions - 1} in a way that depends on the model's history, and position {top} was "
                "requested; keep sequences within max_position_embeddings or use a model with a static rope type"
            )
        freqs = self.long_inv_freq if self.long_from is not None and top >= self.long_from else self.inv_freq
        return torch.tensor(freqs, dtype=torch.float32, device=positions.device)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rope_type": self.rope_type,
            "inv_freq": list(self.inv_freq),
            "attention_scaling": self.attention_scaling,
            "max_positions": self.max_positions,
            "long_inv_freq": None if self.long_inv_freq is None else list(self.long_inv_freq),
            "long_from": self.long_from,
        }


@dataclass(frozen=True)
class RopeSpec:
    """The rotation every layer of a model applies to its keys.

    ``head_dim``: elements per head (rotated and pass-through together).
    ``interleaved``: pair layout, see the module docstring.
    ``kinds``: the distinct rotations.
    ``layer_kinds``: for each real layer index, the name of its kind, or ``None`` for a layer without RoPE (NoPE).
    """

    head_dim: int
    interleaved: bool
    kinds: tuple[RopeKind, ...]
    layer_kinds: tuple[str | None, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", tuple(self.kinds))
        object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))
        names = [k.name for k in self.kinds]
        if len(set(names)) != len(names):
            raise FormatError(f"rope kinds must have distinct names, got {names}")
        for kind in self.kinds:
            if kind.rotary_dim > self.head_dim:
                raise FormatError(
                    f"rope kind {kind.name!r} rotates {kind.rotary_dim} dims but heads have only {self.head_dim}"
                )
        unknown = {k for k in self.layer_kinds if k is not None} - set(names)
        if unknown:
            raise FormatError(f"layers refer to rope kinds {sorted(unknown)} that the spec does not define")

    # ------------------------------------------------------------------ building

    @classmethod
    def from_hf_config(cls, config: Any) -> RopeSpec:
        """The rotation of the transformers model described by ``config`` (a ``PreTrainedConfig``).

        The numbers come from the model's own rotary-embedding class, instantiated on CPU from ``config``; the pair
        layout (half-split or interleaved) and the rotary width are then checked against the model's own
        ``apply_rotary_pos_emb`` on random keys, so a model whose rotation this spec cannot express is refused
        with :class:`~kvtc.errors.UnsupportedModel` instead of being approximated.

        Runs under float32 as the default dtype whatever the caller set (engines such as vLLM set bf16),
        because the model builds its frequencies in float32.
        """
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            return _spec_from_hf_config(config)
        finally:
            torch.set_default_dtype(previous)

    # ------------------------------------------------------------------ rotation

    def kind_of(self, layer: int) -> RopeKind | None:
        """The rotation of real layer ``layer`` (``None``: the layer does not use RoPE)."""
        try:
            index = operator.index(layer) if not isinstance(layer, bool) else -1
        except TypeError:
            index = -1
        if not 0 <= index < len(self.layer_kinds):
            raise LayoutError(f"layer {layer!r} is not a layer of this model (it has {len(self.layer_kinds)})")
        name = self.layer_kinds[index]
        if name is None:
            return None
        return next(k for k in self.kinds if k.name == name)

    def cos_sin(
        self, positions: torch.Tensor, layer: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's ``cos`` and ``sin`` for ``positions`` (int64 ``[...]``) at real layer ``layer``.

        Returns two ``[..., head_dim]`` tensors in ``dtype``, laid out for this spec's pair convention and including
        the attention scaling, such that ``rotated = x * cos + pair_swap(x) * sin`` with ``pair_swap`` the model's
        ``rotate_half``. Pass-through dims (partial rotary, NoPE layers) have ``cos = 1`` and ``sin = 0``.
        """
        kind = self.kind_of(layer)
        shape = (*positions.shape, self.head_dim)
        cos = torch.ones(shape, dtype=dtype, device=positions.device)
        sin = torch.zeros(shape, dtype=dtype, device=positions.device)
        if kind is None or kind.rotary_dim == 0:
            return cos, sin
        c, s = _compact_cos_sin(kind, positions, dtype)
        c, s = c * kind.attention_scaling, s * kind.attention_scaling
        r = kind.rotary_dim
        if self.interleaved:
            cos[..., :r] = c.repeat_interleave(2, dim=-1)
            sin[..., :r] = s.repeat_interleave(2, dim=-1)
        else:
            cos[..., :r] = torch.cat((c, c), dim=-1)
            sin[..., :r] = torch.cat((s, s), dim=-1)
        return cos, sin

    def apply(self, keys: torch.Tensor, positions: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """Rotate pre-RoPE ``keys`` as the model does.

        ``keys``: ``[batch, tokens, len(layers), heads, head_dim]`` (the :class:`~kvtc.layout.KVSlice` layout);
        ``positions``: int64 ``[batch, tokens]``; ``layers``: the real layer index of each entry of dim 2.
        Computed in float32 (float64 for float64 input) and returned in the input dtype.
        """
        return self._rotate_all(keys, positions, layers, inverse=False)

    def apply_to_heads(self, keys: torch.Tensor, positions: torch.Tensor, layers: Sequence[int],
                       dtype: torch.dtype | None = None) -> torch.Tensor:
        """:meth:`apply`, returned as ``[len(layers), batch, heads, tokens, head_dim]`` in ``dtype`` (default: the
        keys'): ``out[i]`` is layer ``i``'s contiguous ``[B, H, T, D]``, the layout Hugging Face caches use.

        On CUDA with the fused kernels (half-split pairs, one rotary width) this is one pass over the keys
        (:mod:`kvtc.kernels.triton_rope`); elsewhere :meth:`apply` followed by a permute.
        """
        layers = tuple(layers)
        dtype = dtype or keys.dtype
        self._check_keys(keys, positions, layers)
        if keys.is_cuda and not self.interleaved and keys.dtype != torch.float64:
            from . import kernels

            widths = {k.rotary_dim for k in map(self.kind_of, layers) if k is not None and k.rotary_dim}
            d = self.head_dim
            if kernels.available(keys.device) and len(widths) <= 1 and not d & (d - 1):
                positions = positions.to(keys.device)
                names: list[str] = []
                cs: list[tuple[torch.Tensor, torch.Tensor]] = []
                index = []
                for layer in layers:
                    kind = self.kind_of(layer)
                    if kind is None or not kind.rotary_dim:
                        index.append(-1)
                        continue
                    if kind.name not in names:
                        c, s = _compact_cos_sin(kind, positions, torch.float32)
                        names.append(kind.name)
                        cs.append((c * kind.attention_scaling, s * kind.attention_scaling))
                    index.append(names.index(kind.name))
                r = widths.pop() if widths else 2
                if not cs:
                    z = torch.zeros((1, *keys.shape[:2], r // 2), device=keys.device)
                    cs = [(z, z)]
                return kernels.rope_to_heads(keys, torch.stack([c for c, _ in cs]), torch.stack([s for _, s in cs]),
                                             torch.tensor(index, dtype=torch.int32), r, dtype)
        return self.apply(keys, positions, layers).to(dtype).permute(2, 0, 3, 1, 4).contiguous()

    def invert(self, keys: torch.Tensor, positions: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """Undo :meth:`apply`: rotate by ``-θ`` and divide by the attention scaling. Same shapes as :meth:`apply`."""
        return self._rotate_all(keys, positions, layers, inverse=True)

    def _check_keys(self, keys: torch.Tensor, positions: torch.Tensor, layers: tuple[int, ...]) -> None:
        if keys.dim() != 5 or keys.shape[2] != len(layers) or keys.shape[4] != self.head_dim:
            raise LayoutError(
                f"keys must be [batch, tokens, {len(layers)} layers, heads, {self.head_dim}], got {tuple(keys.shape)}"
            )
        if positions.dtype != torch.int64 or tuple(positions.shape) != tuple(keys.shape[:2]):
            raise LayoutError(
                f"positions must be int64 [batch, tokens] = {tuple(keys.shape[:2])}, "
                f"got {positions.dtype} {tuple(positions.shape)}"
            )
        if not keys.is_floating_point():
            raise LayoutError(f"keys must be floating point, got {keys.dtype}")

    def _rotate_all(
        self, keys: torch.Tensor, positions: torch.Tensor, layers: Sequence[int], *, inverse: bool
    ) -> torch.Tensor:
        layers = tuple(layers)
        self._check_keys(keys, positions, layers)
        positions = positions.to(keys.device)
        compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
        out = keys.to(compute).clone()
        by_kind: dict[str, list[int]] = {}
        for i, layer in enumerate(layers):
            kind = self.kind_of(layer)
            if kind is not None and kind.rotary_dim:
                by_kind.setdefault(kind.name, []).append(i)
        for name, idx in by_kind.items():
            kind = next(k for k in self.kinds if k.name == name)
            c, s = _compact_cos_sin(kind, positions, compute)
            c, s = c[:, :, None, None, :], s[:, :, None, None, :]  # [batch, tokens, 1, 1, r/2]
            sel = torch.tensor(idx, device=keys.device)
            part = out.index_select(2, sel)
            r = kind.rotary_dim
            rot = part[..., :r]
            if inverse:
                rot = _turn(rot / kind.attention_scaling, c, -s, self.interleaved)
            else:
                scale = kind.attention_scaling
                rot = _turn(rot, c * scale, s * scale, self.interleaved)
            part = torch.cat((rot, part[..., r:]), dim=-1)
            out.index_copy_(2, sel, part)
        return out.to(keys.dtype)

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SPEC_VERSION,
            "head_dim": self.head_dim,
            "interleaved": self.interleaved,
            "kinds": [k.to_dict() for k in self.kinds],
            "layer_kinds": list(self.layer_kinds),
        }

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no whitespace): equal specs give equal strings."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    def fingerprint(self) -> str:
        """Short hash of :meth:`to_json`, recorded next to data coded under this spec."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: Any) -> RopeSpec:
        """Parse :meth:`to_dict` output, validating every field (:class:`~kvtc.errors.FormatError` if malformed,
        :class:`~kvtc.errors.UnsupportedModel` if it needs a rope type this version does not know)."""
        _require_mapping(d, "rope spec", {"version", "head_dim", "interleaved", "kinds", "layer_kinds"})
        version = _req_int(d["version"], "rope spec version")
        if version != SPEC_VERSION:
            raise FormatError(
                f"rope spec version {version} is not supported (this kvtc reads version {SPEC_VERSION}); "
                "use the kvtc version that wrote it or recalibrate"
            )
        head_dim = _req_int(d["head_dim"], "head_dim")
        if head_dim <= 0:
            raise FormatError(f"head_dim must be positive, got {head_dim}")
        if not isinstance(d["interleaved"], bool):
            raise FormatError(f"interleaved must be true or false, got {d['interleaved']!r}")
        if not isinstance(d["kinds"], list):
            raise FormatError("kinds must be a list of rope kinds")
        kinds = tuple(_kind_from_dict(k) for k in d["kinds"])
        if not isinstance(d["layer_kinds"], list) or not d["layer_kinds"]:
            raise FormatError("layer_kinds must be a non-empty list (one entry per layer)")
        for name in d["layer_kinds"]:
            if name is not None and not isinstance(name, str):
                raise FormatError(f"layer_kinds entries must be kind names or null, got {name!r}")
        return cls(head_dim=head_dim, interleaved=d["interleaved"], kinds=kinds, layer_kinds=tuple(d["layer_kinds"]))


def _compact_cos_sin(kind: RopeKind, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., r/2]`` cos and sin of the model's float32 angles (unscaled), evaluated in ``dtype``."""
    # The angle is formed in float32 like the model's rotary embedding; only cos/sin may run wider.
    angle = positions.to(torch.float32)[..., None] * kind.frequencies(positions)
    angle = angle.to(dtype)
    return angle.cos(), angle.sin()


def _turn(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate each pair of ``x`` (``[..., r]``) by the angle whose cos / sin are ``c`` / ``s`` (``[..., r/2]``)."""
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


# ---------------------------------------------------------------------- building from transformers
# transformers is imported lazily: the rotation itself (and loading a stored spec) must not need it.


def _spec_from_hf_config(config: Any) -> RopeSpec:
    text = _text_config(config)
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


def _text_config(config: Any) -> Any:
    try:
        from transformers import PreTrainedConfig
    except ImportError:  # transformers < 5
        from transformers import PretrainedConfig as PreTrainedConfig
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
    import importlib

    import transformers

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
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

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
    return tuple(out)


def _probe(rotary: torch.nn.Module, candidates: list[RopeSpec]) -> RopeSpec:
    """The candidate that reproduces the model's own cos/sin + ``apply_rotary_pos_emb`` on random keys."""
    import importlib

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


# ---------------------------------------------------------------------- strict parsing helpers


def _require_mapping(d: Any, what: str, keys: set[str]) -> None:
    if not isinstance(d, dict):
        raise FormatError(f"{what} must be a mapping, got {type(d).__name__}")
    missing = keys - set(d)
    extra = set(d) - keys
    if missing or extra:
        raise FormatError(
            f"{what} has missing fields {sorted(missing)} / unknown fields {sorted(extra)}; "
            "it was not written by this kvtc version's RopeSpec.to_dict"
        )


def _req_int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise FormatError(f"{what} must be an integer, got {x!r}")
    return x


def _req_float(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise FormatError(f"{what} must be a finite number, got {x!r}")
    return float(x)


def _freq_list(x: Any, what: str) -> tuple[float, ...]:
    if not isinstance(x, list):
        raise FormatError(f"{what} must be a list of numbers")
    out = tuple(_req_float(v, what) for v in x)
    if any(v < 0 for v in out):
        raise FormatError(f"{what} must be non-negative")
    # The spec promises float32 frequencies; anything else was not produced from a model.
    if any(float(torch.tensor(v, dtype=torch.float32)) != v for v in out):
        raise FormatError(f"{what} must hold float32 values exactly (as written by RopeSpec.to_dict)")
    return out


def _kind_from_dict(d: Any) -> RopeKind:
    _require_mapping(
        d,
        "rope kind",
        {"name", "rope_type", "inv_freq", "attention_scaling", "max_positions", "long_inv_freq", "long_from"},
    )
    name, rope_type = d["name"], d["rope_type"]
    if not isinstance(name, str) or not name:
        raise FormatError(f"rope kind name must be a non-empty string, got {name!r}")
    if not isinstance(rope_type, str):
        raise FormatError(f"rope_type must be a string, got {rope_type!r}")
    if rope_type not in KNOWN_ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type {rope_type!r} is not known to this kvtc version (known: {KNOWN_ROPE_TYPES}); upgrade kvtc"
        )
    inv_freq = _freq_list(d["inv_freq"], f"inv_freq of {name!r}")
    scaling = _req_float(d["attention_scaling"], f"attention_scaling of {name!r}")
    if scaling <= 0:
        raise FormatError(f"attention_scaling of {name!r} must be positive, got {scaling}")
    max_positions = d["max_positions"]
    long_inv_freq, long_from = d["long_inv_freq"], d["long_from"]
    if rope_type == "dynamic":
        max_positions = _req_int(max_positions, f"max_positions of dynamic kind {name!r}")
        if max_positions <= 0:
            raise FormatError(f"max_positions of {name!r} must be positive")
    elif max_positions is not None:
        raise FormatError(f"max_positions is only meaningful for dynamic rope, {name!r} is {rope_type!r}")
    if rope_type == "longrope":
        long_freq = _freq_list(long_inv_freq, f"long_inv_freq of {name!r}")
        if len(long_freq) != len(inv_freq):
            raise FormatError(f"long_inv_freq of {name!r} must have {len(inv_freq)} entries, got {len(long_freq)}")
        long_from = _req_int(long_from, f"long_from of {name!r}")
        if long_from <= 0:
            raise FormatError(f"long_from of {name!r} must be positive")
        return RopeKind(name, rope_type, inv_freq, scaling, None, long_freq, long_from)
    if long_inv_freq is not None or long_from is not None:
        raise FormatError(f"long_inv_freq / long_from are only meaningful for longrope, {name!r} is {rope_type!r}")
    return RopeKind(name, rope_type, inv_freq, scaling, max_positions)
