"""Worker side of the connector: the paged caches of one tensor-parallel rank, restored and stored by chunk.

Runs in each vLLM worker process. ``register`` learns every layer's paged layout and KV-cache group and checks the
calibration against the layout this rank holds; ``load`` decodes the chunks the scheduler planned (the second half
of a restore in the codec process, :mod:`.helper`, beside the worker), re-applies RoPE and writes each layer's
blocks in its group (a sliding-window group only has the window's); ``save`` copies completed chunks out of the
cache and hands them to the codec process, which undoes RoPE, encodes them and puts them in the store. A request
whose chunks cannot all be restored is reported to vLLM as a failed load (vLLM recomputes it, nothing is served
from it), and the entries at fault as unusable.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...errors import KVTCError, LayoutError
from ...layout import KVLayout
from ...progress import StageTimer
from ...store import Store
from ...textsafe import message, printable
from .chunks import ChunkCodec
from .codecs import Codecs
from .config import ConnectorSetup
from .groups import CacheGroup, check_chunk
from .helper import DEFAULT_MAX_PENDING_BYTES, CodecProcess, RestoreError
from .metadata import KVTCWorkerMetadata, LoadJob, StoreJob
from .paged import NULL_BLOCK, PagedLayout, SharedIndex, probe_writer
from .stats import Tally

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


class WorkerSide:
    """The caches of rank ``rank`` and their store. ``vllm_config`` is read only to find the attention modules
    of the registered caches. ``background=False``: no codec process; saves are encoded and stored inside
    :meth:`save` and restores decoded by the worker alone (tests)."""

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
        self.chunks: ChunkCodec | None = None
        self.verified = False
        self.loaded: set[str] = set()  # requests whose load finished since the last report
        self.failed: set[str] = set()  # ... of which these failed
        self._report_lock = threading.Lock()
        self.tally = Tally()  # what vLLM collects through get_kv_connector_stats
        self.bad_keys: set[str] = set()
        self.unsaved: set[str] = set()
        self.background = background
        self.max_pending_bytes = max_pending_bytes
        self.helper: CodecProcess | None = None

    def close(self) -> None:
        if self.helper is not None:
            left = self.helper.pending
            if left:  # vLLM terminates the worker after VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS
                logger.info("KVTCConnector: finishing %d chunks being stored before shutting down", left)
            if not self.helper.close(FLUSH_TIMEOUT_S):
                logger.warning("KVTCConnector: %d chunks were still being stored at shutdown", left)
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
        model_id, namespace = self.setup.model_id, self.setup.namespace(self.rank)
        self.chunks = ChunkCodec(self.codecs, self.layout, self.setup.chunk, model_id, self.store)
        self.chunks.warm()  # codecs, plans, embeddings: loaded at start, not by the first restore
        if self.background and self.helper is None:  # starts up (calibration, store) while the engine does
            setup = ChunkCodec.setup(
                self.setup.config, namespace, self.layout, self.codecs.rope, self.codecs.model, model_id,
                self.codecs.checkpoint,
            )  # fmt: skip
            self.helper = CodecProcess(setup, self._saved, self.max_pending_bytes)
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
        assert self.chunks is not None
        self.chunks.pageds = [x.paged for x in self.layers]
        self.chunks.scales = [(x.k_scale, x.v_scale) for x in self.layers]
        if self.helper is not None:
            self.helper.send_layers(self.chunks.pageds, self.chunks.scales)

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
                logger.warning(
                    "KVTCConnector: restoring %s failed (%s); vLLM will recompute it", printable(job.req_id), message(e)
                )
                ok = False
            if ok:
                clock.tokens += job.stop - job.start
                self.tally.add(restored_tokens=job.stop - job.start)
            else:
                clock.failed += job.stop - job.start
                self.tally.add(restore_failed_tokens=job.stop - job.start)
            with self._report_lock:
                self.loaded.add(job.req_id)
                if not ok:
                    self.failed.add(job.req_id)
        logger.debug("KVTCConnector: restored %s", clock)

    def _load_one(self, job: LoadJob, clock: _Timings) -> bool:
        """Restore all of ``job`` (True), or report the first entry that cannot be restored (False)."""
        n = self.setup.chunk
        chunks = [(key, job.first_chunk + i) for i, key in enumerate(job.keys)]
        mine, theirs = chunks, []
        helper = self.helper
        if helper is not None and len(chunks) > 1 and helper.revive():  # the codec process decodes the second half
            half = (len(chunks) + 1) // 2
            mine, theirs = chunks[:half], chunks[half:]
        ticket = helper.request_restore(theirs) if theirs and helper is not None else None
        if theirs and ticket is None:
            mine, theirs = chunks, []
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, c in mine:
            try:
                with clock("store"):
                    blob = self.store.get(key)
                if blob is None:
                    raise KVTCError("entry missing or corrupt in the store")
                with clock("decode"):
                    parts.append(self.chunks.restore(blob, c))  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001
                self._refuse(job, key, c, e)
                if ticket is not None:
                    try:
                        helper.restored(ticket)  # type: ignore[union-attr] - collected, then dropped
                    except RestoreError:
                        pass
                return False
        if ticket is not None:
            try:
                with clock("wait"):
                    parts.append(helper.restored(ticket))  # type: ignore[union-attr]
            except RestoreError as e:
                self._refuse(job, e.key, None, e)
                return False
        with clock("write"):
            keys = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
            values = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            off = job.start - job.first_chunk * n  # the load may start inside its first chunk
            self._write(job, keys[off : off + job.stop - job.start], values[off : off + job.stop - job.start])
        return True

    def _refuse(self, job: LoadJob, key: str | None, chunk: int | None, e: Exception) -> None:
        req = printable(job.req_id)
        where = f"chunk {chunk} of request {req}" if chunk is not None else f"a chunk of request {req}"
        logger.warning(
            "KVTCConnector: %s (key %s…) cannot be restored (%s); vLLM will recompute the request",
            where,
            printable((key or "?")[:16]),
            message(e),
        )
        if key is not None:
            self._forget(key)

    def _write(self, job: LoadJob, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write tokens ``job.start..job.stop-1`` (whole blocks) into each layer's blocks in its group, skipping
        the blocks a sliding-window group dropped."""
        for g, group in enumerate(self.groups):
            bs = group.block_size
            if job.start % bs or job.stop % bs:
                raise LayoutError(f"tokens {job.start}..{job.stop} are not whole blocks of {bs}")
            ids = job.block_ids[g][job.start // bs : job.stop // bs]
            kept = [i for i, b in enumerate(ids) if b != NULL_BLOCK]
            if not kept:
                continue
            sel = None
            if len(kept) < len(ids):
                sel = (torch.tensor(kept)[:, None] * bs + torch.arange(bs)).flatten()
            k_g, v_g = (keys, values) if sel is None else (keys[sel], values[sel])
            index = SharedIndex(torch.arange(len(kept) * bs, dtype=torch.int64))
            for li, layer in enumerate(self.layers):
                if layer.group == g:
                    layer.paged.write_blocks(
                        layer.cache, [ids[i] for i in kept], k_g[:, li], v_g[:, li], layer.k_scale, layer.v_scale, index
                    )

    def _forget(self, key: str) -> None:
        """An entry that cannot be restored: removed from the store (this engine stores it again when it computes
        those tokens) and reported to the scheduler, which stops offering it."""
        try:
            self.store.delete(key)
        except Exception:  # noqa: BLE001 - the report below keeps it from being offered either way
            pass
        with self._report_lock:
            self.bad_keys.add(key)

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
        """Copy the completed chunks out of the cache and queue them for the codec process (a chunk that cannot
        be copied or queued is only a future cache miss)."""
        if not jobs:
            return
        self._verify()
        clock = _Timings()
        for job in jobs:
            blocks: list[torch.Tensor] = []
            queued = False
            try:
                with clock("read"):
                    sources = self._sources(job)
                    if self.helper is not None:
                        queued = self.helper.submit(job.key, job.chunk, sources, job.token_ids)
                    else:
                        blocks = [p.copy_blocks(c, ids) for p, c, ids in sources]
            except Exception as e:  # noqa: BLE001 - a failed save is only a future cache miss
                logger.warning(
                    "KVTCConnector: reading chunk %d of %s failed: %s", job.chunk, printable(job.req_id), message(e)
                )
                self.tally.add(save_failures=1)
                self._unsaved(job.key)
                continue
            if self.helper is None:
                self._save_inline(job, blocks)
            elif queued:
                clock.tokens += self.setup.chunk
            else:
                clock.refused += 1
                self.tally.add(saves_refused=1)
                self._unsaved(job.key)
        if self.helper is not None:
            logger.debug("KVTCConnector: queued for storing %s", clock)

    def _unsaved(self, key: str) -> None:
        with self._report_lock:
            self.unsaved.add(key)

    def _sources(self, job: StoreJob) -> list[tuple[PagedLayout, torch.Tensor, list[int]]]:
        """Per layer: its paged layout, its cache and the blocks holding the job's chunk."""
        n = self.setup.chunk
        start = job.chunk * n
        blocks = []
        for g, group in enumerate(self.groups):
            bs = group.block_size
            ids = job.block_ids[g][start // bs : (start + n + bs - 1) // bs]
            if len(ids) * bs != n or NULL_BLOCK in ids:
                raise LayoutError(f"KV-cache group {g} no longer holds the chunk's blocks")
            blocks.append(ids)
        return [(layer.paged, layer.cache, blocks[layer.group]) for layer in self.layers]

    def _saved(self, key: str, size: int | None, seconds: dict[str, float], error: str | None) -> None:
        """The word on one chunk's save (from the codec process's reply thread, or inline)."""
        if error is not None:
            logger.warning(
                "KVTCConnector: storing the chunk under key %s… failed: %s", printable(key[:16]), message(error)
            )
        clock = _Timings()
        clock.seconds.update(seconds)
        if size is not None:
            clock.tokens, clock.bytes = self.setup.chunk, size
            self.tally.add(stored_chunks=1, stored_tokens=self.setup.chunk, stored_bytes=size)
        else:
            if error is None:
                clock.refused += 1  # the store did not take it (e.g. larger than its max_bytes)
            self.tally.add(**{"save_failures" if error is not None else "saves_refused": 1})
            self._unsaved(key)
        logger.debug("KVTCConnector: stored %s", clock.summary(sum(seconds.values())))

    def _save_inline(self, job: StoreJob, blocks: list[torch.Tensor]) -> None:
        """Encode and store one chunk here (no codec process)."""
        clock = _Timings()
        try:
            size = self.chunks.save(job.key, job.chunk, blocks, clock, job.token_ids)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - a failed save is only a future cache miss
            self._saved(job.key, None, clock.seconds, f"{type(e).__name__}: {e}")
            return
        self._saved(job.key, size, clock.seconds, None)


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
        return self.summary(self.elapsed())

    def summary(self, seconds: float) -> str:
        notes = [f"{k} {v:.3f}" for k, v in self.seconds.items()]
        if self.bytes:
            notes.append(f"{self.bytes} bytes")
        if self.failed:
            notes.append(f"{self.failed} tokens not restored, recomputed by vLLM")
        if self.refused:
            notes.append(f"{self.refused} chunks refused by the store or dropped")
        return f"{self.tokens} tokens in {seconds:.3f} s ({', '.join(notes)})"
