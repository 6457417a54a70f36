"""Read and write token slots of vLLM's paged KV cache, one layer tensor at a time.

vLLM hands a connector one tensor per attention layer. Since vLLM 0.2x that tensor is a *logical*
``[num_blocks, kv_heads, block_size, content]`` view whose physical stride order is the layout the
backend asked for (``KVCacheLayout``); indexing the logical view is therefore correct for every stride
order. What the view does not say is where keys and values sit inside ``content``; each backend's
``do_kv_cache_update`` decides that:

* ``"content"`` (FlashAttention, FlashInfer, Triton): ``content = [key(head_dim) | value(head_dim)]`` per token;
* ``"rows"`` (the CPU backend): a block's ``[block_size, 2 * head_dim]`` memory is read as
  ``[2 * block_size, head_dim]``: the block's keys first, then its values.

Older vLLM releases passed 5-D tensors with a separate K/V axis; those layouts are named here too
(``"kv_first"``: ``[2, blocks, block_size, heads, head_dim]`` FlashAttention; ``"kv_second"``:
``[blocks, 2, block_size, heads, head_dim]`` FlashInfer; ``"kv_first_hnd"``: ``[2, blocks, heads,
block_size, head_dim]`` the old CPU backend).

:func:`verify_writer` checks an adapter against the backend's own writer on a scratch block, so an
unexpected layout (a new release, a packed ISA-specific format) is refused instead of read wrongly.

Slot of token ``p`` of a request: ``block_ids[p // block_size] * block_size + p % block_size``.
Keys and values cross this module as ``[tokens, heads, head_dim]`` in the caller's float dtype; fp8
caches are (de)quantized with the layer's per-tensor scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ...errors import LayoutError

#: Backend name (``AttentionBackend.get_name()``) -> where K and V sit in a 4-D layer view.
BACKEND_SPLITS: dict[str, str] = {
    "CPU_ATTN": "rows",
    "FLASH_ATTN": "content",
    "FLASHINFER": "content",
    "TRITON_ATTN": "content",
}

SPLITS = ("content", "rows", "kv_first", "kv_second", "kv_first_hnd", "probed")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

#: vLLM's null block: what a block table holds where a sliding-window KV-cache group has dropped a block.
NULL_BLOCK = 0


def slots_for(block_ids: Sequence[int], block_size: int, start: int, stop: int) -> torch.Tensor:
    """Slots (int64 ``[stop - start]``) of token positions ``start..stop-1`` of a request owning ``block_ids``."""
    if not 0 <= start <= stop or stop > len(block_ids) * block_size:
        raise LayoutError(
            f"tokens {start}..{stop} do not fit the request's {len(block_ids)} blocks of {block_size} tokens"
        )
    pos = torch.arange(start, stop, dtype=torch.int64)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)
    return blocks[pos // block_size] * block_size + pos % block_size


class SharedIndex:
    """Storage offsets of one run of slots, computed once for all layer tensors that share a layout and strides."""

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots
        self.memo: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def __call__(self, paged: PagedLayout, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = (id(paged), cache.stride(), cache.device)
        if key not in self.memo:
            self.memo[key] = paged.index(cache, self.slots)
        return self.memo[key]


@dataclass(frozen=True)
class PagedLayout:
    """How one layer's paged tensor holds K and V.

    ``split``: one of :data:`SPLITS` (see the module docstring). ``block_size``, ``num_heads`` (heads on
    this rank) and ``head_dim`` describe the tensor; ``fp8_dtype`` is the element type of an fp8 cache
    stored as bytes (``None``: the cache holds floats).
    """

    split: str
    block_size: int
    num_heads: int
    head_dim: int
    fp8_dtype: torch.dtype | None = None
    #: ``"probed"`` only: where the backend's writer put each element of a block, as logical ``(head, row,
    #: content)`` coordinates of the 4-D view, int64 ``[2 (K, V), block_size, heads, head_dim, 3]``.
    table: torch.Tensor | None = field(default=None, compare=False, repr=False)
    #: ``"probed"`` only: the table as storage offsets within a block, per stride of the layer tensor.
    _linear: dict = field(default_factory=dict, compare=False, repr=False, init=False)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise LayoutError(f"unknown paged K/V split {self.split!r}; use one of {SPLITS}")
        if min(self.block_size, self.num_heads, self.head_dim) <= 0:
            raise LayoutError("block_size, num_heads and head_dim must be positive")

    @classmethod
    def for_backend(
        cls, backend_name: str, cache: torch.Tensor, num_heads: int, head_dim: int, cache_dtype: str = "auto"
    ) -> PagedLayout:
        """The layout of ``cache`` as the backend called ``backend_name`` writes it (checks the tensor's shape)."""
        fp8 = _fp8_dtype(cache_dtype)
        if cache.dim() == 4:
            split = BACKEND_SPLITS.get(backend_name)
            if split is None:
                raise LayoutError(
                    f"kvtc does not know how attention backend {backend_name!r} stores K and V; "
                    f"supported: {sorted(BACKEND_SPLITS)}"
                )
            _, h, n, c = cache.shape
            if h != num_heads or c != 2 * head_dim:
                raise LayoutError(
                    f"{backend_name} cache {tuple(cache.shape)} is not [blocks, {num_heads}, block_size, {2 * head_dim}]"
                )
            return cls(split, int(n), num_heads, head_dim, fp8)
        if cache.dim() == 5:
            s = tuple(cache.shape)
            if s[0] == 2 and s[3:] == (num_heads, head_dim):
                return cls("kv_first", s[2], num_heads, head_dim, fp8)
            if s[1] == 2 and s[3:] == (num_heads, head_dim):
                return cls("kv_second", s[2], num_heads, head_dim, fp8)
            if s[0] == 2 and s[2] == num_heads and s[4] == head_dim:
                return cls("kv_first_hnd", s[3], num_heads, head_dim, fp8)
        raise LayoutError(f"unrecognised paged KV tensor of shape {tuple(cache.shape)} for {backend_name!r}")

    # ------------------------------------------------------------------ views
    def _kv(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
        """K and V views of ``cache`` and their axis order: "bnhd" or "bhnd" (b: block, n: token in block)."""
        if self.fp8_dtype is not None and cache.dtype not in FP8_DTYPES:
            cache = cache.view(self.fp8_dtype)
        if self.split == "content":
            return cache[..., : self.head_dim], cache[..., self.head_dim :], "bhnd"
        if self.split == "rows":
            b, h, n, _ = cache.shape
            rows = cache.view(b, h, 2, n, self.head_dim)
            return rows[:, :, 0], rows[:, :, 1], "bhnd"
        if self.split == "kv_first":
            return cache[0], cache[1], "bnhd"
        if self.split == "kv_second":
            return cache[:, 0], cache[:, 1], "bnhd"
        return cache[0], cache[1], "bhnd"

    def _probed_offsets(self, cache: torch.Tensor, slots: torch.Tensor, which: int) -> torch.Tensor:
        """Storage offsets (int64 ``[len(slots), heads, head_dim]``, relative to ``cache``'s own offset) of
        the K (``which=0``) or V (1) elements of ``slots``: one flat index, so a whole chunk of every
        head moves in a single gather / scatter."""
        assert self.table is not None
        st = cache.stride()
        lin = self._linear.get(st)
        if lin is None:
            t = self.table
            lin = t[..., 0] * st[1] + t[..., 1] * st[2] + t[..., 2] * st[3]  # [2, block_size, heads, head_dim]
            self._linear[st] = lin
        lin = lin.to(cache.device)
        blk, off = slots // self.block_size, slots % self.block_size
        return (blk * st[0])[:, None, None] + lin[which][off]

    def copy_blocks(
        self, cache: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A contiguous copy of blocks ``block_ids`` of ``cache``, laid out like the cache (block ``i`` of the copy
        is ``block_ids[i]``), into ``out`` when given: whole blocks move as plain memory copies, and :meth:`gather`
        reads the copy later with slots ``0..len(block_ids) * block_size - 1``."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64, device=cache.device)
        axis = self.block_axis()
        if out is None:
            return cache.index_select(axis, ids)
        return torch.index_select(cache, axis, ids, out=out)

    def block_axis(self) -> int:
        """The axis of a layer tensor that indexes blocks."""
        return 1 if self.split in ("kv_first", "kv_first_hnd") else 0

    def write_blocks(
        self,
        cache: torch.Tensor,
        block_ids: Sequence[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        index: SharedIndex | None = None,
    ) -> None:
        """Write whole blocks: ``keys``/``values`` ``[len(block_ids) * block_size, heads, head_dim]`` fill blocks
        ``block_ids`` in order. The blocks are laid out in a small contiguous buffer first (:meth:`scatter`), then
        copied into the cache block by block: much faster than scattering into the large cache tensor."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64, device=cache.device)
        axis = self.block_axis()
        shape = list(cache.shape)
        shape[axis] = len(ids)
        local = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        slots = torch.arange(len(ids) * self.block_size, dtype=torch.int64, device=cache.device)
        self.scatter(local, slots, keys, values, k_scale, v_scale, index(self, local) if index is not None else None)
        cache.index_copy_(axis, ids, local)

    def index(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Precomputed K and V storage offsets of ``slots`` for :meth:`gather` / :meth:`scatter` (``"probed"``
        layouts; ``None`` otherwise). Valid for every layer tensor with ``cache``'s strides."""
        if self.split != "probed":
            return None
        slots = slots.to(device=cache.device, dtype=torch.int64)
        return self._probed_offsets(cache, slots, 0), self._probed_offsets(cache, slots, 1)

    @staticmethod
    def _flat(cache: torch.Tensor) -> torch.Tensor:
        """A 1-D view of ``cache``'s storage from the tensor's first element on."""
        n = cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset()
        return cache.as_strided((n,), (1,))

    def gather(
        self,
        cache: torch.Tensor,
        slots: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        dtype: torch.dtype | None = None,
        index: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[len(slots), heads, head_dim]`` held at ``slots`` (fp8 caches are dequantized).
        ``index``: :meth:`index` of these slots, shared by layers with the same strides."""
        slots = slots.to(device=cache.device, dtype=torch.int64)
        if self.split == "probed":
            if self.fp8_dtype is not None and cache.dtype not in FP8_DTYPES:
                cache = cache.view(self.fp8_dtype)
            flat = self._flat(cache)
            ki, vi = index if index is not None else self.index(cache, slots)  # type: ignore[misc]
            keys, values = flat[ki], flat[vi]
        else:
            k, v, order = self._kv(cache)
            blk, off = slots // self.block_size, slots % self.block_size
            if order == "bhnd":
                keys, values = k[blk, :, off], v[blk, :, off]
            else:
                keys, values = k[blk, off], v[blk, off]
        if self.fp8_dtype is not None:
            out = dtype or torch.float32
            return keys.to(out) * k_scale, values.to(out) * v_scale
        return (keys, values) if dtype is None else (keys.to(dtype), values.to(dtype))

    def scatter(
        self,
        cache: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        index: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Write ``keys``/``values`` ``[len(slots), heads, head_dim]`` to ``slots`` (cast to the cache's dtype)."""
        want = (int(slots.numel()), self.num_heads, self.head_dim)
        if tuple(keys.shape) != want or tuple(values.shape) != want:
            raise LayoutError(f"keys/values must be {want}, got {tuple(keys.shape)} / {tuple(values.shape)}")
        slots = slots.to(device=cache.device, dtype=torch.int64)
        if self.fp8_dtype is not None:
            if cache.dtype not in FP8_DTYPES:
                cache = cache.view(self.fp8_dtype)
            keys = (keys.float() / k_scale).to(cache.dtype)
            values = (values.float() / v_scale).to(cache.dtype)
        keys, values = (
            keys.to(device=cache.device, dtype=cache.dtype),
            values.to(device=cache.device, dtype=cache.dtype),
        )
        if self.split == "probed":
            flat = self._flat(cache)
            ki, vi = index if index is not None else self.index(cache, slots)  # type: ignore[misc]
            flat[ki] = keys
            flat[vi] = values
            return
        k, v, order = self._kv(cache)
        blk, off = slots // self.block_size, slots % self.block_size
        if order == "bhnd":
            k[blk, :, off] = keys
            v[blk, :, off] = values
        else:
            k[blk, off] = keys
            v[blk, off] = values


def _fp8_dtype(cache_dtype: str) -> torch.dtype | None:
    if cache_dtype in ("auto", "bfloat16", "float16", "float32", "half", "float", ""):
        return None
    if cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    raise LayoutError(f"kvtc cannot read a {cache_dtype!r} KV cache; use bf16/fp16 or an fp8 cache")


Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def probe_writer(like: torch.Tensor, write: Writer, num_heads: int, head_dim: int, dtype: torch.dtype) -> PagedLayout:
    """Learn where the backend's own writer ``write(keys, values, cache, slots)`` puts each K/V element.

    ``like``: a layer's 4-D paged tensor (its per-block shape, dtype and device are used; it is not written).
    Writes one block of small integers (exact in bf16, fp16 and fp8) on scratch memory, one pass per base-16
    digit of every element's index, and reads the digits back: the result is exact for any placement a kernel
    chooses (including ISA-specific transposed key blocks), and a writer that drops or duplicates elements is
    refused with :class:`LayoutError`.
    """
    if like.dim() != 4:
        raise LayoutError(f"probing needs a 4-D [blocks, heads, block_size, content] cache, got {tuple(like.shape)}")
    _, h, n, c = like.shape
    if h != num_heads or c * n < 2 * n * head_dim:
        raise LayoutError(f"cache {tuple(like.shape)} cannot hold {num_heads} heads of 2 x {head_dim} per token")
    scratch = torch.zeros((2, h, n, c), dtype=like.dtype, device=like.device)
    slots = torch.arange(n, 2 * n, dtype=torch.int64, device=like.device)  # block 1: the block index must matter
    numel = n * num_heads * head_dim
    idx = torch.arange(numel, device=like.device).reshape(n, num_heads, head_dim)

    def written(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        scratch.zero_()
        write(keys.to(dtype), values.to(dtype), scratch, slots)
        if scratch[0].any():
            raise LayoutError("the backend's cache writer wrote outside the block it was given")
        return scratch[1].to(torch.float32, copy=True).flatten()  # a copy also for float32 caches: scratch is reused

    kind = written(torch.ones_like(idx), torch.full_like(idx, 2))
    ident = torch.zeros_like(kind, dtype=torch.int64)
    digit = 1
    while digit < numel:
        got = written((idx // digit) % 16 + 1, (idx // digit) % 16 + 1)
        ident += (got.to(torch.int64) - 1).clamp(min=0) * digit
        digit *= 16
    pos = torch.arange(kind.numel(), device=like.device)
    table = torch.empty((2, numel, 3), dtype=torch.int64, device=like.device)
    for which, code in ((0, 1.0), (1, 2.0)):
        mask = kind == code
        ids, where = ident[mask], pos[mask]
        if ids.numel() != numel or not torch.equal(torch.sort(ids).values, torch.arange(numel, device=like.device)):
            raise LayoutError(
                "the backend's cache writer does not store every key and value element exactly once in a block; "
                "kvtc's connector cannot read this KV cache layout"
            )
        table[which, ids] = torch.stack((where // (n * c), (where // c) % n, where % c), dim=-1)
    return PagedLayout("probed", n, num_heads, head_dim, None, table.reshape(2, n, num_heads, head_dim, 3).cpu())
