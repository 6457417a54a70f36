"""What KV a model produces, how it is laid out as feature rows, and how features are grouped for PCA.

Conventions (asserted at every boundary):

* Layers are named by the model's *real* layer index (a hybrid model whose layers 3, 7, 11 carry KV has
  ``layers == (3, 7, 11)``), never by their position among KV-carrying layers.
* A token's feature row concatenates, in this order, every layer of ``layers``, every KV head of
  ``heads`` and every element of ``head_dim``: ``p = len(layers) * len(heads) * head_dim``.
* A :class:`KVSlice` holds keys and values as ``[batch, tokens, layers, heads, head_dim]`` so that the
  reshape to rows ``[batch * tokens, p]`` is free. Keys in a slice are **pre-RoPE**.
* A layer may hold fewer tokens than the sequence has: a sliding-window layer keeps only its newest
  ``layout.max_tokens[i]`` tokens (``0``: every token, full attention). In a slice, the tokens a layer does not
  hold are zero and are never stored; layers that hold the same tokens form one :class:`Span`, and every PCA
  group lies inside one span (:meth:`PCAGrouping.groups`), so no bit goes to a token no layer reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .errors import LayoutError

#: the most tokens a layer may be declared to hold (a cap on what a blob or calibration may claim)
MAX_TOKENS = 1 << 22

#: dtypes a slice may carry, with their on-disk codes (the container stores the code).
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise LayoutError(f"unsupported KV dtype {dtype}; kvtc handles {sorted(DTYPES)} (cast fp8 caches first)")


@dataclass(frozen=True)
class KVLayout:
    """The KV a model (or one tensor-parallel shard of it) produces.

    ``layers``: real indices of the layers that carry KV, ascending.
    ``heads``: the KV head indices present (all heads unless this is a tensor-parallel shard).
    ``num_kv_heads``: KV heads per layer in the full model.
    ``max_tokens``: per layer of ``layers``, the most (newest) tokens its cache holds; ``0`` for a layer that holds
    every token. Empty (the default) when every layer holds every token.
    """

    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    heads: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    max_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        limits = tuple(int(x) for x in self.max_tokens)
        object.__setattr__(self, "max_tokens", limits if any(limits) else ())
        if limits and (len(limits) != len(self.layers) or min(limits) < 0 or max(limits) > MAX_TOKENS):
            raise LayoutError(
                f"max_tokens needs one entry in [0, {MAX_TOKENS}] per layer ({len(self.layers)}), got {limits}"
            )
        heads = tuple(int(h) for h in self.heads) if self.heads else tuple(range(self.num_kv_heads))
        object.__setattr__(self, "heads", heads)
        if not self.layers:
            raise LayoutError("a KV layout needs at least one layer that carries KV")
        if list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise LayoutError(f"layers must be distinct, ascending, non-negative real indices, got {self.layers}")
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise LayoutError(f"num_kv_heads and head_dim must be positive, got {self.num_kv_heads}, {self.head_dim}")
        if list(heads) != sorted(set(heads)) or heads[0] < 0 or heads[-1] >= self.num_kv_heads:
            raise LayoutError(f"heads must be distinct ascending indices below {self.num_kv_heads}, got {heads}")
        if self.dtype not in DTYPES:
            raise LayoutError(f"unsupported dtype {self.dtype!r}; use one of {sorted(DTYPES)}")

    @property
    def num_features(self) -> int:
        """``p``: the length of one token's feature row."""
        return len(self.layers) * len(self.heads) * self.head_dim

    @property
    def model_shape(self) -> tuple[tuple[int, ...], int, int, tuple[int, ...]]:
        """``(layers, num_kv_heads, head_dim, max_tokens)``: what must agree between KV, a calibration and a model
        (heads and dtype may differ: a tensor-parallel shard, a storage dtype)."""
        return self.layers, self.num_kv_heads, self.head_dim, self.max_tokens

    def limit(self, index: int) -> int:
        """``max_tokens`` of the layer at position ``index`` of :attr:`layers` (0: every token)."""
        return self.max_tokens[index] if self.max_tokens else 0

    @property
    def spans(self) -> tuple[Span, ...]:
        """The layers grouped by how many tokens they hold, in order of their first layer."""
        order: dict[int, list[int]] = {}
        for i in range(len(self.layers)):
            order.setdefault(self.limit(i), []).append(i)
        return tuple(Span(limit, tuple(idx)) for limit, idx in order.items())

    def held(self, index: int, tokens: int) -> int:
        """Tokens of a ``tokens``-long sequence that the layer at position ``index`` holds (its newest ones)."""
        limit = self.limit(index)
        return tokens if limit == 0 else min(limit, tokens)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def pair_columns(self, layer: int, head: int) -> range:
        """Columns of the feature row holding (real layer index, KV head)."""
        try:
            li = self.layers.index(layer)
            hi = self.heads.index(head)
        except ValueError:
            raise LayoutError(f"(layer {layer}, head {head}) is not part of this layout") from None
        start = (li * len(self.heads) + hi) * self.head_dim
        return range(start, start + self.head_dim)

    def shard(self, heads: tuple[int, ...]) -> KVLayout:
        """The layout of a tensor-parallel rank that holds ``heads``."""
        missing = set(heads) - set(self.heads)
        if missing:
            raise LayoutError(f"heads {sorted(missing)} are not in this layout")
        return dataclasses.replace(self, heads=tuple(sorted(heads)))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "layers": list(self.layers),
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "heads": list(self.heads),
            "dtype": self.dtype,
        }
        if self.max_tokens:  # absent when every layer holds every token (the description is then as before)
            d["max_tokens"] = list(self.max_tokens)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> KVLayout:
        if not isinstance(d, dict):
            raise LayoutError("layout must be a mapping")
        try:
            return cls(
                layers=tuple(_int_list(d["layers"])),
                num_kv_heads=_int(d["num_kv_heads"]),
                head_dim=_int(d["head_dim"]),
                heads=tuple(_int_list(d["heads"])),
                dtype=str(d["dtype"]),
                max_tokens=tuple(_int_list(d["max_tokens"])) if "max_tokens" in d else (),
            )
        except (KeyError, TypeError) as e:
            raise LayoutError(f"malformed layout description: {e!r}") from None


@dataclass(frozen=True)
class Span:
    """Layers that hold the same tokens: ``limit`` newest ones (0: all); ``indices`` are positions in
    ``layout.layers``."""

    limit: int
    indices: tuple[int, ...]

    def held(self, tokens: int) -> int:
        """Tokens of a ``tokens``-long sequence these layers hold (the newest ones)."""
        return tokens if self.limit == 0 else min(self.limit, tokens)

    def protected(self, tokens: int, sinks: int, window: int) -> tuple[int, int, int]:
        """``(first, sinks, window)``: the index of the first held token, and how many of the ``sinks`` oldest
        tokens of the sequence and of its ``window`` newest these layers hold (kept exact by the codec)."""
        n = self.held(tokens)
        first = tokens - n
        s = min(max(sinks - first, 0), n)
        return first, s, min(window, n - s)


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise LayoutError(f"expected an integer, got {x!r}")
    return x


def _int_list(x: Any) -> list[int]:
    if not isinstance(x, list):
        raise LayoutError(f"expected a list of integers, got {type(x).__name__}")
    return [_int(v) for v in x]


@dataclass(frozen=True)
class PCAGrouping:
    """A partition of the layout's (layer, head) pairs into groups that each get their own PCA.

    ``kind``:
      * ``"global"`` (default, the paper's best): one group holding every layer and head;
      * ``"layers"``: ``size`` consecutive KV layers per group (``size=1``: one group per layer);
      * ``"head_shards"``: ``size`` shards of the heads, all layers each (tensor parallelism: a rank
        holding one shard can encode alone).

    A group never mixes layers that hold different tokens (:attr:`KVLayout.spans`): on a model with
    sliding-window and full-attention layers, ``"global"`` is one group per kind of layer, ``"layers"`` groups
    stop where the kind changes, and each head shard is split by kind.
    """

    kind: str = "global"
    size: int = 1

    KINDS = ("global", "layers", "head_shards")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise LayoutError(f"unknown PCA grouping {self.kind!r}; use one of {self.KINDS}")
        if self.size <= 0:
            raise LayoutError("PCA grouping size must be positive")

    def groups(self, layout: KVLayout) -> list[list[tuple[int, int]]]:
        """The (layer, head) pairs of each group, in feature-row order within a group."""
        spans = layout.spans
        if self.kind == "global":
            return [[(layout.layers[i], h) for i in sp.indices for h in layout.heads] for sp in spans]
        if self.kind == "layers":
            out: list[list[tuple[int, int]]] = []
            run: list[int] = []
            for i in range(len(layout.layers)):
                if run and (len(run) == self.size or layout.limit(run[-1]) != layout.limit(i)):
                    out.append([(layout.layers[j], h) for j in run for h in layout.heads])
                    run = []
                run.append(i)
            out.append([(layout.layers[j], h) for j in run for h in layout.heads])
            return out
        n = self.size
        if len(layout.heads) % n:
            raise LayoutError(f"{len(layout.heads)} heads cannot be split into {n} equal shards")
        per = len(layout.heads) // n
        shards = [layout.heads[i * per : (i + 1) * per] for i in range(n)]
        return [[(layout.layers[i], h) for i in sp.indices for h in shard] for sp in spans for shard in shards]

    def span_of(self, layout: KVLayout) -> list[Span]:
        """The :class:`Span` each group lies in, in group order."""
        by_layer = {layout.layers[i]: sp for sp in layout.spans for i in sp.indices}
        return [by_layer[group[0][0]] for group in self.groups(layout)]

    def columns(self, layout: KVLayout) -> list[torch.Tensor]:
        """Feature-row column indices (int64) of each group."""
        out = []
        for group in self.groups(layout):
            cols = [c for (layer, h) in group for c in layout.pair_columns(layer, h)]
            out.append(torch.tensor(cols, dtype=torch.int64))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "size": self.size}

    @classmethod
    def from_dict(cls, d: Any) -> PCAGrouping:
        if not isinstance(d, dict):
            raise LayoutError("grouping must be a mapping")
        return cls(kind=str(d.get("kind", "global")), size=_int(d.get("size", 1)))


@dataclass
class KVSlice:
    """Keys and values of one or more sequences, ready for the codec.

    ``keys`` / ``values``: ``[batch, tokens, len(layout.layers), len(layout.heads), head_dim]``, keys pre-RoPE.
    ``positions``: ``[batch, tokens]`` int64 absolute positions (needed to re-apply RoPE).
    A layer that holds fewer tokens (``layout.max_tokens``) holds the newest ones; its older entries are zero.
    ``model_id``: free-form name of the model the KV came from (recorded, checked on decode when given).
    """

    layout: KVLayout
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    model_id: str = ""
    #: int64 ``[batch, tokens]``: the token ids the KV was computed from, where known (a codec whose calibration
    #: carries a token map needs them, and decoding its blobs gives them back)
    token_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        lay = self.layout
        want = (len(lay.layers), len(lay.heads), lay.head_dim)
        for name, t in (("keys", self.keys), ("values", self.values)):
            if not isinstance(t, torch.Tensor) or t.dim() != 5 or tuple(t.shape[2:]) != want:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise LayoutError(
                    f"{name} must be [batch, tokens, {want[0]}, {want[1]}, {want[2]}] for this layout, got {shape}"
                )
        if self.keys.shape != self.values.shape:
            raise LayoutError(f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} differ in shape")
        if self.positions.shape != self.keys.shape[:2] or self.positions.dtype != torch.int64:
            raise LayoutError(
                f"positions must be int64 [batch, tokens] = {tuple(self.keys.shape[:2])}, "
                f"got {self.positions.dtype} {tuple(self.positions.shape)}"
            )
        ids = self.token_ids
        if ids is not None and (
            not isinstance(ids, torch.Tensor) or ids.shape != self.keys.shape[:2] or ids.dtype != torch.int64
        ):
            raise LayoutError(f"token_ids must be int64 [batch, tokens] = {tuple(self.keys.shape[:2])} or None")

    @property
    def batch(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[1])

    def held_tokens(self) -> int:
        """Sum over layers of the tokens each layer holds, per sequence."""
        lay = self.layout
        return sum(lay.held(i, self.num_tokens) for i in range(len(lay.layers)))

    def nbytes(self) -> int:
        """Bytes of the K and V the layers hold, in the layout's dtype (the uncompressed size a ratio is measured
        against)."""
        lay = self.layout
        esize = torch.empty((), dtype=lay.torch_dtype).element_size()
        return 2 * self.batch * self.held_tokens() * len(lay.heads) * lay.head_dim * esize
