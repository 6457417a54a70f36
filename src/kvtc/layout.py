"""What KV a model produces, how it is laid out as feature rows, and how features are grouped for PCA.

Conventions (asserted at every boundary):

* Layers are named by the model's *real* layer index (a hybrid model whose layers 3, 7, 11 carry KV has
  ``layers == (3, 7, 11)``), never by their position among KV-carrying layers.
* A token's feature row concatenates, in this order, every layer of ``layers``, every KV head of
  ``heads`` and every element of ``head_dim``: ``p = len(layers) * len(heads) * head_dim``.
* A :class:`KVSlice` holds keys and values as ``[batch, tokens, layers, heads, head_dim]`` so that the
  reshape to rows ``[batch * tokens, p]`` is free. Keys in a slice are **pre-RoPE**.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .errors import LayoutError

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
    """

    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    heads: tuple[int, ...] = ()
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
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
    def model_shape(self) -> tuple[tuple[int, ...], int, int]:
        """``(layers, num_kv_heads, head_dim)``: what must agree between KV, a calibration and a model
        (heads and dtype may differ: a tensor-parallel shard, a storage dtype)."""
        return self.layers, self.num_kv_heads, self.head_dim

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
        return {
            "layers": list(self.layers),
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "heads": list(self.heads),
            "dtype": self.dtype,
        }

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
            )
        except (KeyError, TypeError) as e:
            raise LayoutError(f"malformed layout description: {e!r}") from None


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
        """The (layer, head) pairs of each group, in feature-row order."""
        pairs = [[(layer, h) for h in layout.heads] for layer in layout.layers]
        if self.kind == "global":
            return [[p for row in pairs for p in row]]
        if self.kind == "layers":
            return [[p for row in pairs[i : i + self.size] for p in row] for i in range(0, len(pairs), self.size)]
        n = self.size
        if len(layout.heads) % n:
            raise LayoutError(f"{len(layout.heads)} heads cannot be split into {n} equal shards")
        per = len(layout.heads) // n
        shards = [layout.heads[i * per : (i + 1) * per] for i in range(n)]
        return [[(layer, h) for layer in layout.layers for h in shard] for shard in shards]

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
    ``model_id``: free-form name of the model the KV came from (recorded, checked on decode when given).
    """

    layout: KVLayout
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    model_id: str = ""

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

    @property
    def batch(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[1])

    def nbytes(self) -> int:
        """Bytes of K and V in the layout's dtype (the uncompressed size a ratio is measured against)."""
        return 2 * self.keys.numel() * torch.empty((), dtype=self.layout.torch_dtype).element_size()
