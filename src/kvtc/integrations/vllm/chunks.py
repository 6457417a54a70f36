"""One stored chunk, both ways: copied blocks -> blob in the store, and blob -> keys and values to write back.

:class:`ChunkCodec` is used by the worker itself (restores, and saves when they run inline) and by its codec
process (:mod:`.helper`), which builds its own from the JSON description :meth:`ChunkCodec.setup` gives. Also here:
which CPUs the model's OpenMP threads are bound to, and which are left for the codec process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import LayoutError
from ...layout import KVLayout, KVSlice
from ...progress import StageTimer
from .paged import PagedLayout, SharedIndex


class ChunkCodec:
    """Encodes chunks from their copied blocks and decodes stored ones, for one rank's layout.

    ``codecs``: the :class:`~.codecs.Codecs` of the configuration; ``store``: the rank's store; ``pageds[i]`` and
    ``scales[i]`` describe how layer ``i`` of ``layout`` holds K and V (needed to read copied blocks only).
    """

    def __init__(
        self,
        codecs: Any,
        layout: KVLayout,
        chunk_tokens: int,
        model_id: str,
        store: Any,
        pageds: list[PagedLayout] | None = None,
        scales: list[tuple[float, float]] | None = None,
    ) -> None:
        self.codecs = codecs
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.model_id = model_id
        self.store = store
        self.pageds = pageds or []
        self.scales = scales or []

    # -- description for the codec process -----------------------------------------------------
    @staticmethod
    def setup(
        config: Any,
        namespace: str,
        layout: KVLayout,
        rope: Any,
        model: str,
        model_id: str,
        checkpoint: str | None = None,
    ) -> dict[str, Any]:
        """What a codec process builds its :class:`ChunkCodec` from (JSON); ``checkpoint``: the served model's
        path or hub id (a token-map calibration reads its input embeddings there)."""
        fields = ("codec", "calibration", "ratio", "store", "chunk_tokens", "sinks")
        return {
            "checkpoint": checkpoint,
            "config": {f: getattr(config, f) for f in fields},
            "namespace": namespace,
            "layout": layout.to_dict(),
            "rope": None if rope is None else rope.to_dict(),
            "model": model,
            "model_id": model_id,
        }

    @classmethod
    def from_setup(cls, setup: dict[str, Any]) -> ChunkCodec:
        from ...rope import RopeSpec
        from .codecs import Codecs, load_calibration
        from .config import ConnectorConfig, open_connector_store

        config = ConnectorConfig(**setup["config"])
        layout = KVLayout.from_dict(setup["layout"])
        if config.codec == "identity":
            codecs = Codecs(config, None, None, setup["model"])
        else:
            rope = RopeSpec.from_dict(setup["rope"])
            codecs = Codecs(config, load_calibration(config), rope, setup["model"], setup.get("checkpoint"))
        codecs.check(layout)
        store = open_connector_store(config, setup["namespace"])
        return cls(codecs, layout, config.chunk_tokens, setup["model_id"], store)

    @staticmethod
    def layers_setup(pageds: list[PagedLayout], scales: list[tuple[float, float]]) -> dict[str, Any]:
        """Each layer's paged layout (the probed ones included) and scales, as JSON."""
        unique: dict[int, int] = {}
        tables = []
        for p in pageds:
            if id(p) not in unique:
                unique[id(p)] = len(tables)
                tables.append(paged_to_dict(p))
        return {"pageds": tables, "layers": [[unique[id(p)], k, v] for p, (k, v) in zip(pageds, scales)]}

    def set_layers(self, d: dict[str, Any]) -> None:
        tables = [paged_from_dict(t) for t in d["pageds"]]
        self.pageds = [tables[i] for i, _, _ in d["layers"]]
        self.scales = [(float(k), float(v)) for _, k, v in d["layers"]]

    # -- save ------------------------------------------------------------------------------------
    def gather(self, blocks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[chunk_tokens, layers, heads, head_dim]`` (cache dtype; fp8: float32) of a chunk's
        copied blocks (one tensor per layer, laid out like the layer's cache)."""
        if len(self.pageds) != len(blocks):
            raise LayoutError(f"{len(blocks)} layers of blocks for {len(self.pageds)} known layer layouts")
        slots = torch.arange(self.chunk_tokens, dtype=torch.int64)
        index = SharedIndex(slots)
        ks, vs = [], []
        for paged, (ksc, vsc), copy in zip(self.pageds, self.scales, blocks):
            k, v = paged.gather(copy, slots, ksc, vsc, index=index(paged, copy))
            ks.append(k)
            vs.append(v)
        return torch.stack(ks, dim=1), torch.stack(vs, dim=1)

    def save(
        self,
        key: str,
        chunk: int,
        blocks: Sequence[torch.Tensor],
        clock: StageTimer,
        token_ids: Sequence[int] | None = None,
    ) -> int | None:
        """Encode chunk ``chunk`` from its copied blocks and put it in the store under ``key``: the blob's bytes,
        or None when the store did not take it. ``token_ids``: the chunk's token ids (needed when the calibration
        carries a token map)."""
        n, lay, codecs = self.chunk_tokens, self.layout, self.codecs
        positions = torch.arange(chunk * n, (chunk + 1) * n, dtype=torch.int64)[None]
        with clock("gather"):
            keys, values = self.gather(blocks)
        keys, values = keys[None], values[None]  # [1, tokens, layers, heads, head_dim]
        with clock("encode"):
            if not codecs.post_rope:
                keys = codecs.rope.invert(keys.float(), positions, lay.layers)
            kv = KVSlice(lay, keys.to(lay.torch_dtype), values.to(lay.torch_dtype), positions, model_id=self.model_id)
            ids = None if not token_ids else torch.tensor([list(token_ids)], dtype=torch.int64)
            blob = codecs.codec(lay, chunk == 0).encode(kv, token_ids=ids)
        with clock("store"):
            stored = self.store.put(key, blob)
        return len(blob) if stored else None

    def warm(self) -> None:
        """Build now what the first save or restore would build on demand: the codecs of a first and a later chunk
        (plans, PCA transforms; a token-map calibration's input embeddings, read from the checkpoint) and the code
        paths of one encode and decode each, on a synthetic chunk. Called at engine start (worker and codec process),
        so that the first restore costs what later ones do."""
        lay, n = self.layout, self.chunk_tokens
        g = torch.Generator().manual_seed(0)
        shape = (1, n, len(lay.layers), len(lay.heads), lay.head_dim)
        kv = KVSlice(
            lay,
            (torch.randn(shape, generator=g) * 0.1).to(lay.torch_dtype),
            (torch.randn(shape, generator=g) * 0.1).to(lay.torch_dtype),
            torch.arange(n, dtype=torch.int64)[None],
            model_id=self.model_id,
        )
        for first in (True, False):
            codec = self.codecs.codec(lay, first)
            ids = torch.zeros((1, n), dtype=torch.int64) if codec.needs_token_ids else None
            codec.decode(codec.encode(kv, token_ids=ids))

    # -- restore ---------------------------------------------------------------------------------
    def restore(self, blob: bytes, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE keys and values ``[chunk_tokens, layers, heads, head_dim]`` of stored chunk ``chunk``
        (keys in float32 when RoPE was re-applied)."""
        codecs, lay, n = self.codecs, self.layout, self.chunk_tokens
        kv = codecs.codec(lay, chunk == 0).decode(blob)
        if kv.layout != lay:
            raise LayoutError(f"blob holds layout {kv.layout}, expected {lay}")
        if kv.positions.shape != (1, n) or not torch.equal(
            kv.positions[0], torch.arange(chunk * n, (chunk + 1) * n, dtype=torch.int64)
        ):
            raise LayoutError("blob holds other token positions than the chunk it is stored under")
        if codecs.post_rope:
            return kv.keys[0], kv.values[0]
        keys = codecs.rope.apply(kv.keys.float(), kv.positions, lay.layers)[0]
        return keys, kv.values[0]


def paged_to_dict(p: PagedLayout) -> dict[str, Any]:
    return {
        "split": p.split,
        "block_size": p.block_size,
        "num_heads": p.num_heads,
        "head_dim": p.head_dim,
        "fp8": None if p.fp8_dtype is None else str(p.fp8_dtype).removeprefix("torch."),
        "table": None if p.table is None else p.table.tolist(),
    }


def paged_from_dict(d: dict[str, Any]) -> PagedLayout:
    fp8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}.get(d["fp8"]) if d["fp8"] else None
    table = None if d["table"] is None else torch.tensor(d["table"], dtype=torch.int64)
    return PagedLayout(d["split"], int(d["block_size"]), int(d["num_heads"]), int(d["head_dim"]), fp8, table)


# -- CPUs ----------------------------------------------------------------------------------------------------
def cpu_list(text: str) -> set[int]:
    """CPUs of a list such as ``0-3,6`` or ``0 1 2`` (commas or spaces, ranges)."""
    cpus: set[int] = set()
    for part in filter(None, re.split(r"[,\s]+", text.strip())):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on: the cgroup's cpuset (a thread's own mask may be narrower: vLLM binds the
    worker's main thread to the model's CPUs), else every CPU."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            with open(path) as f:
                cpus = cpu_list(f.read())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def model_cpus() -> set[int]:
    """The CPUs vLLM's CPU worker bound the model's OpenMP threads to, read from the variable it sets for the
    OpenMP runtime in use (``OMP_PLACES={0,1}``, ``GOMP_CPU_AFFINITY=0 1``, ``KMP_AFFINITY=...proclist=[0,1]``);
    empty when none is set."""
    env = os.environ
    try:
        if m := re.fullmatch(r"\{([\d,\s]+)\}", env.get("OMP_PLACES", "").strip()):
            return cpu_list(m.group(1))
        if gomp := env.get("GOMP_CPU_AFFINITY", "").strip():
            return cpu_list(gomp)
        if m := re.search(r"proclist=\[([\d,\-\s]+)\]", env.get("KMP_AFFINITY", "")):
            return cpu_list(m.group(1))
    except ValueError:
        pass
    return set()


def spare_cpus() -> set[int]:
    """CPUs this process may use that the model's OpenMP threads are not bound to (empty: none, or unknown)."""
    bound = model_cpus()
    return allowed_cpus() - bound if bound else set()
