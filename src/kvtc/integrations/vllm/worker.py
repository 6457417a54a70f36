"""Worker side of the connector: the paged caches of one tensor-parallel rank, restored and stored by chunk.

Runs in each vLLM worker process. ``register`` learns every layer's paged layout and KV-cache group and checks the
calibration against the layout this rank holds; ``load`` decodes the chunks the scheduler planned, re-applies RoPE
and writes each layer's slots in its group's blocks (a sliding-window group only has the window's); ``save`` copies
completed chunks out of the cache and hands them to a background thread (:mod:`.saver`) that undoes RoPE, encodes
them and puts them in the store. A request whose chunks cannot all be restored is reported to vLLM as a failed
load (vLLM recomputes it, nothing is served from it), and the entries at fault as unusable.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...errors import KVTCError, LayoutError
from ...layout import KVLayout, KVSlice
from ...progress import StageTimer
from ...store import Store
from .codecs import Codecs
from .config import ConnectorSetup
from .groups import CacheGroup, check_chunk
from .metadata import KVTCWorkerMetadata, LoadJob, StoreJob
from .paged import NULL_BLOCK, PagedLayout, SharedIndex, held_slots, probe_writer
from .saver import DEFAULT_MAX_PENDING_BYTES, Background

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("kvtc.vllm")

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: seconds a shutting-down worker waits for queued saves
FLUSH_TIMEOUT_S = 600.0


def worker_rank(tp_size: int) -> int:
    """This worker's tensor-parallel rank."""
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


@dataclass
class _Layer:
    name: str
    index: int
    cache: torch.Tensor
    paged: PagedLayout
    k_scale: float
    v_scale: float
    group: int = 0
    held: int = 0  # tokens the layer holds before the current one (0: all)


@dataclass
class _Copied:
    """A completed chunk's blocks copied out of every layer's paged cache, waiting to be encoded and stored."""

    job: StoreJob
    blocks: list[torch.Tensor]  # per layer: the chunk's whole blocks, laid out like the cache
    read_s: float

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.blocks)


class WorkerSide:
    """The caches of rank ``rank`` and their store. ``vllm_config`` is read only to find the attention modules
    of the registered caches. ``background=False`` encodes and stores inside :meth:`save` (tests)."""

    def __init__(
        self,
        setup: ConnectorSetup,
        codecs: Codecs,
        rank: int,
        store: Store,
        vllm_config: VllmConfig | None = None,
        background: bool = True,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        self.setup = setup
        self.codecs = codecs
        self.rank = rank
        self.heads = setup.heads(rank)
        self.store = store
        self.vllm_config = vllm_config
        self.groups: tuple[CacheGroup, ...] = setup.groups or (CacheGroup(setup.block_size),)
        self.layers: list[_Layer] = []
        self.modules: dict[str, Any] = {}
        self.layout: KVLayout | None = None
        self.verified = False
        self.loaded: set[str] = set()  # requests whose load finished since the last report
        self.failed: set[str] = set()  # ... of which these failed
        self._report_lock = threading.Lock()
        self.bad_keys: set[str] = set()
        self.unsaved: set[str] = set()
        self._save_codecs = codecs.twin()  # the background thread's own codec objects
        self.saver = Background("kvtc-save", self._store_copied, max_pending_bytes) if background else None

    def close(self) -> None:
        if self.saver is not None and not self.saver.close(FLUSH_TIMEOUT_S):
            logger.warning("KVTCConnector: %d chunks were still being stored at shutdown", self.saver.pending)
        self.store.close()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """``register_kv_caches``: find each cache's attention module, then :meth:`attach` the caches."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        vcfg = self.vllm_config
        assert vcfg is not None, "register needs the engine's VllmConfig"
        modules = get_layers_from_vllm_config(vcfg, AttentionLayerBase, list(kv_caches))
        self.attach(kv_caches, modules, str(vcfg.cache_config.cache_dtype))

    def attach(self, kv_caches: dict[str, torch.Tensor], modules: dict[str, Any], cache_dtype: str) -> None:
        """Take the paged caches (layer name -> tensor) with their attention modules (a layer without one is
        read with the CPU backend's layout) and check that the calibration fits the layout they hold."""
        head_dim = self.setup.head_dim
        group_of = {name: g for g, group in enumerate(self.groups) for name in group.layer_names}
        layers = []
        for name, cache in kv_caches.items():
            m = _LAYER_INDEX.search(name)
            if m is None:
                raise LayoutError(f"cannot read a layer index from vLLM layer name {name!r}")
            module = modules.get(name)
            backend = module.get_attn_backend().get_name() if module is not None else "CPU_ATTN"
            paged = PagedLayout.for_backend(backend, cache, len(self.heads), head_dim, cache_dtype)
            g = group_of.get(name, 0)
            window = getattr(module, "sliding_window", None) or self.groups[g].window
            layers.append(
                _Layer(
                    name,
                    int(m.group(1)),
                    cache,
                    paged,
                    float(getattr(module, "_k_scale_float", 1.0)),
                    float(getattr(module, "_v_scale_float", 1.0)),
                    group=g,
                    held=int(window) - 1 if window else 0,
                )
            )
        if not layers:
            raise LayoutError("vLLM registered no KV caches with the connector; there is nothing to store")
        layers.sort(key=lambda x: x.index)
        first = layers[0]
        self.layers = layers
        self.modules = modules
        self.layout = KVLayout(
            layers=tuple(x.index for x in layers),
            num_kv_heads=self.setup.total_kv_heads,
            head_dim=head_dim,
            heads=self.heads,
            dtype=self.codecs.dtype(torch.float32 if first.paged.fp8_dtype else first.cache.dtype),
            max_tokens=tuple(x.held for x in layers),
        )
        check_chunk(self.setup.chunk, self.setup.block_size, self.layout.max_tokens)
        self.codecs.check(self.layout)  # at startup: this rank's layout against the calibration
        logger.info(
            "KVTCConnector: %d layers in %d KV-cache group(s)%s, heads %s of %d, %s split, chunk %d tokens, "
            "store namespace %s",
            len(layers),
            len(self.groups),
            "".join(f", window {g.window}" for g in self.groups if g.window)[:80],
            self.heads,
            self.setup.total_kv_heads,
            first.paged.split,
            self.setup.chunk,
            self.setup.namespace(self.rank),
        )

    def _verify(self) -> None:
        """Learn each layer's K/V placement from the backend's own cache writer, once, on scratch memory.

        Runs at the first load or save rather than in ``register_kv_caches``: the backend finishes setting
        up its layers (e.g. the CPU kernel's ISA) after the caches are registered.
        """
        if self.verified:
            return
        self.verified = True
        probed: dict[tuple, PagedLayout] = {}
        for layer in self.layers:
            module = self.modules.get(layer.name)
            impl = getattr(module, "impl", None)
            if impl is None or not hasattr(impl, "do_kv_cache_update") or layer.paged.fp8_dtype is not None:
                continue  # fp8 caches: the declared layout of the backend is used as is
            sig = (type(impl).__name__, tuple(layer.cache.shape[1:]), layer.cache.dtype, getattr(module, "isa", None))
            if sig not in probed:

                def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
                    impl.do_kv_cache_update(module, k, v, cache, slots)  # noqa: B023 - probed in this iteration

                probed[sig] = probe_writer(layer.cache, write, len(self.heads), self.setup.head_dim, layer.cache.dtype)
            layer.paged = probed[sig]

    # -- load ----------------------------------------------------------------------------------
    def load(self, jobs: list[LoadJob]) -> None:
        """Restore the planned requests; each is then reported done, and failed unless all of it was restored."""
        if not jobs:
            return
        self._verify()
        clock = _Timings()
        for job in jobs:
            try:
                ok = self._load_one(job, clock)
            except Exception as e:  # noqa: BLE001 - any failure means "recompute", never "serve"
                logger.warning("KVTCConnector: restoring %s failed (%s); vLLM will recompute it", job.req_id, e)
                ok = False
            if ok:
                clock.tokens += job.stop - job.start
            else:
                clock.failed += job.stop - job.start
            with self._report_lock:
                self.loaded.add(job.req_id)
                if not ok:
                    self.failed.add(job.req_id)
        logger.debug("KVTCConnector: restored %s", clock)

    def _load_one(self, job: LoadJob, clock: _Timings) -> bool:
        """Restore all of ``job`` (True), or report the first entry that cannot be restored (False)."""
        chunk = self.setup.chunk
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, key in enumerate(job.keys):
            c = job.first_chunk + i
            lo, hi = max(job.start, c * chunk), min(job.stop, (c + 1) * chunk)
            try:
                with clock("store"):
                    blob = self.store.get(key)
                if blob is None:
                    raise KVTCError("entry missing or corrupt in the store")
                with clock("decode"):
                    keys, values = self._decode(blob, c)
            except Exception as e:  # noqa: BLE001
                logger.warning(
                    "KVTCConnector: chunk %d of request %s (tokens %d..%d, key %s…) cannot be restored (%s); "
                    "vLLM will recompute the request",
                    c,
                    job.req_id,
                    lo,
                    job.stop,
                    key[:16],
                    e,
                )
                self._forget(key)
                return False
            off = lo - c * chunk
            parts.append((keys[off : off + hi - lo], values[off : off + hi - lo]))
        with clock("write"):
            keys = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
            values = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            for g, group in enumerate(self.groups):
                sel, slots = held_slots(job.block_ids[g], group.block_size, job.start, job.stop)
                if slots.numel() == 0:
                    continue
                k_g, v_g = (keys, values) if sel is None else (keys[sel], values[sel])
                index = SharedIndex(slots)
                for li, layer in enumerate(self.layers):
                    if layer.group == g:
                        layer.paged.scatter(
                            layer.cache,
                            slots,
                            k_g[:, li],
                            v_g[:, li],
                            layer.k_scale,
                            layer.v_scale,
                            index(layer.paged, layer.cache),
                        )
        return True

    def _forget(self, key: str) -> None:
        """An entry that cannot be restored: removed from the store (this engine stores it again when it computes
        those tokens) and reported to the scheduler, which stops offering it."""
        try:
            self.store.delete(key)
        except Exception:  # noqa: BLE001 - the report below keeps it from being offered either way
            pass
        with self._report_lock:
            self.bad_keys.add(key)

    def _decode(self, blob: bytes, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE keys and values ``[chunk_tokens, layers, heads, head_dim]`` of stored chunk ``chunk``."""
        assert self.layout is not None
        codecs = self.codecs
        kv = codecs.codec(self.layout, chunk == 0).decode(blob)
        n = self.setup.chunk
        if kv.layout != self.layout:
            raise LayoutError(f"blob holds layout {kv.layout}, expected {self.layout}")
        if kv.positions.shape != (1, n) or not torch.equal(
            kv.positions[0], torch.arange(chunk * n, (chunk + 1) * n, dtype=torch.int64)
        ):
            raise LayoutError("blob holds other token positions than the chunk it is stored under")
        if codecs.post_rope:
            return kv.keys[0], kv.values[0]
        assert codecs.rope is not None
        keys = codecs.rope.apply(kv.keys.float(), kv.positions, self.layout.layers)[0]
        return keys, kv.values[0]

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose load finished since the last call, and those of them that failed."""
        with self._report_lock:
            done, failed = self.loaded, self.failed
            self.loaded, self.failed = set(), set()
        return done, failed

    def take_report(self) -> KVTCWorkerMetadata | None:
        """Entries found unusable and chunks not stored since the last call, for the scheduler."""
        with self._report_lock:
            if not self.bad_keys and not self.unsaved:
                return None
            meta = KVTCWorkerMetadata(self.bad_keys, self.unsaved)
            self.bad_keys, self.unsaved = set(), set()
        return meta

    # -- save ----------------------------------------------------------------------------------
    def save(self, jobs: list[StoreJob]) -> None:
        """Copy the completed chunks out of the cache and queue them for encoding and storing (a chunk that
        cannot be copied or queued is only a future cache miss)."""
        if not jobs:
            return
        self._verify()
        clock = _Timings()
        for job in jobs:
            t0 = time.perf_counter()
            try:
                blocks = self._read(job)
            except Exception as e:  # noqa: BLE001 - a failed save is only a future cache miss
                logger.warning("KVTCConnector: reading chunk %d of %s failed: %s", job.chunk, job.req_id, e)
                self._unsaved(job.key)
                continue
            item = _Copied(job, blocks, time.perf_counter() - t0)
            clock.add("read", item.read_s)
            if self.saver is None:
                self._store_copied(item)
            elif self.saver.submit(item, item.nbytes):
                clock.tokens += self.setup.chunk
            else:
                clock.refused += 1
                self._unsaved(job.key)
        if self.saver is not None:
            logger.debug("KVTCConnector: queued for storing %s", clock)

    def _unsaved(self, key: str) -> None:
        with self._report_lock:
            self.unsaved.add(key)

    def _read(self, job: StoreJob) -> list[torch.Tensor]:
        """The chunk's blocks in every layer, copied (plain memory copies; :meth:`_gather` reads them later)."""
        n = self.setup.chunk
        start = job.chunk * n
        copies: list[torch.Tensor | None] = [None] * len(self.layers)
        for g, group in enumerate(self.groups):
            bs = group.block_size
            blocks = job.block_ids[g][start // bs : (start + n + bs - 1) // bs]
            if len(blocks) * bs != n or NULL_BLOCK in blocks:
                raise LayoutError(f"KV-cache group {g} no longer holds the chunk's blocks")
            for li, layer in enumerate(self.layers):
                if layer.group == g:
                    copies[li] = layer.paged.copy_blocks(layer.cache, blocks)
        return copies  # type: ignore[return-value]

    def _gather(self, blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[chunk_tokens, layers, heads, head_dim]`` in the cache dtype (fp8 caches: float32)
        of a chunk's copied blocks."""
        slots = torch.arange(self.setup.chunk, dtype=torch.int64)
        index = SharedIndex(slots)
        ks, vs = [], []
        for layer, copy in zip(self.layers, blocks):
            k, v = layer.paged.gather(copy, slots, layer.k_scale, layer.v_scale, index=index(layer.paged, copy))
            ks.append(k)
            vs.append(v)
        return torch.stack(ks, dim=1), torch.stack(vs, dim=1)

    def _store_copied(self, item: _Copied) -> None:
        """Encode a copied chunk and put it in the store (on the background thread)."""
        job = item.job
        clock = _Timings()
        clock.add("read", item.read_s)
        try:
            blob = self._encode(item, clock)
            with clock("store"):
                stored = self.store.put(job.key, blob)
        except Exception as e:  # noqa: BLE001 - a failed save is only a future cache miss
            logger.warning("KVTCConnector: storing chunk %d of %s failed: %s", job.chunk, job.req_id, e)
            self._unsaved(job.key)
            return
        if stored:
            clock.tokens += self.setup.chunk
            clock.bytes += len(blob)
        else:
            clock.refused += 1
            self._unsaved(job.key)
        logger.debug("KVTCConnector: stored %s", clock)

    def _encode(self, item: _Copied, clock: _Timings) -> bytes:
        assert self.layout is not None
        n = self.setup.chunk
        codecs = self._save_codecs
        dt = self.layout.torch_dtype
        positions = torch.arange(item.job.chunk * n, (item.job.chunk + 1) * n, dtype=torch.int64)[None]
        with clock("gather"):
            keys, values = self._gather(item.blocks)
        keys, values = keys[None], values[None]  # [1, tokens, layers, heads, head_dim]
        with clock("encode"):
            if not codecs.post_rope:
                assert codecs.rope is not None
                keys = codecs.rope.invert(keys.float(), positions, self.layout.layers)
            kv = KVSlice(self.layout, keys.to(dt), values.to(dt), positions, model_id=self.setup.model_id)
            return codecs.codec(self.layout, item.job.chunk == 0).encode(kv)


class _Timings(StageTimer):
    """What a step's loads, one step's copies for storing, or one chunk's save did, and the seconds per stage
    (logged at DEBUG level).

    ``tokens``: tokens restored into the cache, queued for storing, or stored (accepted by the store); ``bytes``:
    stored bytes; ``failed``: planned tokens not restored (vLLM recomputes them); ``refused``: chunks the store
    did not take, or the save queue had no room for.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0
        self.bytes = 0
        self.failed = 0
        self.refused = 0

    def __str__(self) -> str:
        notes = [f"{k} {v:.3f}" for k, v in self.seconds.items()]
        if self.bytes:
            notes.append(f"{self.bytes} bytes")
        if self.failed:
            notes.append(f"{self.failed} tokens not restored, recomputed by vLLM")
        if self.refused:
            notes.append(f"{self.refused} chunks refused by the store or dropped")
        return f"{self.tokens} tokens in {self.elapsed():.3f} s ({', '.join(notes)})"
