"""Worker side of the connector: the paged caches of one tensor-parallel rank, restored and stored by chunk.

Runs in each vLLM worker process. ``register`` learns every layer's paged layout and checks the calibration
against the layout this rank holds; ``load`` decodes the chunks the scheduler planned, re-applies RoPE and
writes the slots before the forward; ``save`` reads completed chunks after the forward, undoes RoPE, encodes
them and puts them in the store. A chunk that cannot be restored is reported to vLLM as a load error (it is
recomputed, never served), and the step that ran on it stores nothing.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...errors import KVTCError, LayoutError
from ...layout import KVLayout, KVSlice
from ...progress import StageTimer
from ...store import Store
from .codecs import Codecs
from .config import ConnectorSetup
from .metadata import LoadJob, StoreJob
from .paged import PagedLayout, probe_writer, slots_for

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("kvtc.vllm")

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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


class WorkerSide:
    """The caches of rank ``rank`` and their store. ``vllm_config`` is read only to find the attention modules
    of the registered caches."""

    def __init__(
        self, setup: ConnectorSetup, codecs: Codecs, rank: int, store: Store, vllm_config: VllmConfig | None = None
    ) -> None:
        self.setup = setup
        self.codecs = codecs
        self.rank = rank
        self.heads = setup.heads(rank)
        self.store = store
        self.vllm_config = vllm_config
        self.layers: list[_Layer] = []
        self.modules: dict[str, Any] = {}
        self.layout: KVLayout | None = None
        self.load_errors: set[int] = set()
        self.failed_reqs: set[str] = set()
        self.verified = False

    def close(self) -> None:
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
        layers = []
        for name, cache in kv_caches.items():
            m = _LAYER_INDEX.search(name)
            if m is None:
                raise LayoutError(f"cannot read a layer index from vLLM layer name {name!r}")
            module = modules.get(name)
            backend = module.get_attn_backend().get_name() if module is not None else "CPU_ATTN"
            paged = PagedLayout.for_backend(backend, cache, len(self.heads), head_dim, cache_dtype)
            layers.append(
                _Layer(
                    name,
                    int(m.group(1)),
                    cache,
                    paged,
                    float(getattr(module, "_k_scale_float", 1.0)),
                    float(getattr(module, "_v_scale_float", 1.0)),
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
        )
        self.codecs.check(self.layout)  # at startup: this rank's layout against the calibration
        logger.info(
            "KVTCConnector: %d layers, heads %s of %d, %s split, chunk %d tokens, store namespace %s",
            len(layers),
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
        """Restore the planned chunks; what cannot be restored is reported by :meth:`take_load_errors`."""
        if not jobs:
            return
        self._verify()
        clock = _Timings()
        bs = self.setup.block_size
        for job in jobs:
            try:
                upto = self._load_one(job, clock)
            except Exception as e:  # noqa: BLE001 - any failure means "recompute", never "serve"
                logger.warning("KVTCConnector: restoring %s failed (%s); vLLM will recompute it", job.req_id, e)
                upto = job.start
            if upto < job.stop:
                self.load_errors.update(job.block_ids[upto // bs : (job.stop + bs - 1) // bs])
                self.failed_reqs.add(job.req_id)
                clock.failed += job.stop - upto
        logger.debug("KVTCConnector: restored %s", clock)

    def _load_one(self, job: LoadJob, clock: _Timings) -> int:
        """Restore what can be restored of ``job``; returns the first token not restored (``job.stop``: all)."""
        chunk, bs = self.setup.chunk, self.setup.block_size
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        upto = job.stop
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
                    "vLLM will recompute it",
                    c,
                    job.req_id,
                    lo,
                    job.stop,
                    key[:16],
                    e,
                )
                upto = lo
                break
            off = lo - c * chunk
            parts.append((lo, hi, keys[off : off + hi - lo], values[off : off + hi - lo]))
        if not parts:
            return upto
        with clock("write"):
            lo, hi = parts[0][0], parts[-1][1]
            keys = torch.cat([p[2] for p in parts]) if len(parts) > 1 else parts[0][2]
            values = torch.cat([p[3] for p in parts]) if len(parts) > 1 else parts[0][3]
            slots = slots_for(job.block_ids, bs, lo, hi)
            index = _SharedIndex(slots)
            for li, layer in enumerate(self.layers):
                layer.paged.scatter(
                    layer.cache, slots, keys[:, li], values[:, li], layer.k_scale, layer.v_scale, index=index(layer)
                )
        clock.tokens += hi - lo
        return upto

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

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # -- save ----------------------------------------------------------------------------------
    def save(self, jobs: list[StoreJob]) -> None:
        """Encode and store the completed chunks (a chunk that fails is only a future cache miss)."""
        failed, self.failed_reqs = self.failed_reqs, set()
        if not jobs:
            return
        self._verify()
        clock = _Timings()
        for job in jobs:
            if job.req_id in failed:
                continue  # this step ran on KV that failed to load: never store what it produced
            try:
                blob = self._encode(job, clock)
                with clock("store"):
                    stored = self.store.put(job.key, blob)
            except Exception as e:  # noqa: BLE001 - a failed save is only a future cache miss
                logger.warning("KVTCConnector: storing chunk %d of %s failed: %s", job.chunk, job.req_id, e)
                continue
            if stored:
                clock.tokens += self.setup.chunk
                clock.bytes += len(blob)
            else:
                clock.refused += 1
        logger.debug("KVTCConnector: stored %s", clock)

    def _encode(self, job: StoreJob, clock: _Timings) -> bytes:
        assert self.layout is not None
        n, bs = self.setup.chunk, self.setup.block_size
        codecs = self.codecs
        dt = self.layout.torch_dtype
        with clock("read"):
            slots = slots_for(job.block_ids, bs, job.chunk * n, (job.chunk + 1) * n)
            ks, vs = [], []
            index = _SharedIndex(slots)
            for layer in self.layers:
                k, v = layer.paged.gather(
                    layer.cache,
                    slots,
                    layer.k_scale,
                    layer.v_scale,
                    dtype=dt if codecs.post_rope else torch.float32,
                    index=index(layer),
                )
                ks.append(k)
                vs.append(v)
            positions = torch.arange(job.chunk * n, (job.chunk + 1) * n, dtype=torch.int64)[None]
            keys = torch.stack(ks, dim=1)[None]  # [1, tokens, layers, heads, head_dim]
            values = torch.stack(vs, dim=1)[None]
        with clock("encode"):
            if not codecs.post_rope:
                assert codecs.rope is not None
                keys = codecs.rope.invert(keys, positions, self.layout.layers)
            kv = KVSlice(self.layout, keys.to(dt), values.to(dt), positions, model_id=self.setup.model_id)
            return codecs.codec(self.layout, job.chunk == 0).encode(kv)


class _SharedIndex:
    """Storage offsets of one run of slots, computed once for all layers that share a layout and strides."""

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots
        self.memo: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def __call__(self, layer: _Layer) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = (id(layer.paged), layer.cache.stride(), layer.cache.device)
        if key not in self.memo:
            self.memo[key] = layer.paged.index(layer.cache, self.slots)
        return self.memo[key]


class _Timings(StageTimer):
    """What one step's loads or saves did, and the seconds spent per stage (logged at DEBUG level).

    ``tokens``: tokens restored into the cache, or stored (accepted by the store); ``bytes``: stored bytes;
    ``failed``: planned tokens not restored (vLLM recomputes them); ``refused``: chunks the store did not take.
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
            notes.append(f"{self.refused} chunks refused by the store")
        return f"{self.tokens} tokens in {self.elapsed():.3f} s ({', '.join(notes)})"
