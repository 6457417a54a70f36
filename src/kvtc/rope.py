"""Exact rotary position embedding (RoPE) of a model, as a self-contained, serialisable :class:`RopeSpec`.

kvtc codes keys *pre-RoPE* (ALGORITHM.md, step 2): the adapter undoes the model's rotation after reading a cache
and re-applies it before handing the cache back. Both directions must be the model's own rotation, bit for bit
where possible, so the spec stores the *numbers* the model computes (its float32 inverse frequencies and
attention scaling, per layer kind) rather than the recipe (theta, scaling type). Equal specs rotate identically; a
calibration records the spec's :meth:`RopeSpec.fingerprint` and refuses keys produced under another one.

This module is the maths only: rotating, inverting, serialising. Reading a spec from a model is the engine
adapter's work (:func:`kvtc.integrations.hf.rope_spec_from_config` asks the model's own rotary-embedding class
for the numbers and checks them against the model's own rotation).

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

    def apply_to_heads(
        self,
        keys: torch.Tensor,
        positions: torch.Tensor,
        layers: Sequence[int],
        dtype: torch.dtype | None = None,
        tables: Any = None,
    ) -> torch.Tensor:
        """:meth:`apply`, returned as ``[len(layers), batch, heads, tokens, head_dim]`` in ``dtype`` (default: the
        keys'): ``out[i]`` is layer ``i``'s contiguous ``[B, H, T, D]``, the layout Hugging Face caches use.

        On CUDA with the fused kernels (half-split pairs, one rotary width) this is one pass over the keys
        (:mod:`kvtc.kernels.triton_rope`); elsewhere :meth:`apply` followed by a permute. ``tables``:
        :meth:`head_tables` made from this very ``positions`` tensor for these layers or more, once for layer-by-layer
        calls (others are not used: the tables are made here).
        """
        layers = tuple(layers)
        dtype = dtype or keys.dtype
        self._check_keys(keys, positions, layers)
        if keys.is_cuda and keys.dtype != torch.float64:
            usable = tables is not None and tables.fits(keys.device, positions, layers)
            tables = tables if usable else self.head_tables(positions.to(keys.device), layers)
            if tables is not None:
                from . import kernels

                return kernels.rope_to_heads(
                    keys, tables.cos, tables.sin, tables.kinds(layers), tables.rotary_dim, dtype
                )
        return self.apply(keys, positions, layers).to(dtype).permute(2, 0, 3, 1, 4).contiguous()

    def head_tables(self, positions: torch.Tensor, layers: Sequence[int]) -> Any:
        """The cos / sin tables (:class:`~kvtc.kernels.triton_rope.RopeTables`) of :meth:`apply_to_heads`' fused
        pass for ``layers`` at ``positions`` (on their device), or None where that pass does not apply (off CUDA,
        interleaved pairs, several rotary widths, a head_dim that is not a power of two). Making them reads the
        positions back (a device sync): made once before a layer-by-layer restore starts, the per-layer calls wait
        for nothing."""
        from . import kernels

        layers = tuple(layers)
        widths = {k.rotary_dim for k in map(self.kind_of, layers) if k is not None and k.rotary_dim}
        d = self.head_dim
        if self.interleaved or len(widths) > 1 or d & (d - 1) or not kernels.available(positions.device):
            return None
        names: list[str] = []
        cs: list[tuple[torch.Tensor, torch.Tensor]] = []
        index = {}
        for layer in layers:
            kind = self.kind_of(layer)
            if kind is None or not kind.rotary_dim:
                index[layer] = -1
                continue
            if kind.name not in names:
                c, s = _compact_cos_sin(kind, positions, torch.float32)
                names.append(kind.name)
                cs.append((c * kind.attention_scaling, s * kind.attention_scaling))
            index[layer] = names.index(kind.name)
        r = widths.pop() if widths else 2
        if not cs:
            z = torch.zeros((1, *positions.shape, r // 2), device=positions.device)
            cs = [(z, z)]
        cos, sin = torch.stack([c for c, _ in cs]), torch.stack([s for _, s in cs])
        return kernels.rope_tables(cos.contiguous(), sin.contiguous(), index, r, positions)

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
