"""`KVTCConnector`: a vLLM V1 KV connector that keeps compressed prefixes in a kvtc store.

Store path: after each forward (``wait_for_save``, plain Python, outside any compiled region) the worker
takes the request chunks that this step completed, reads them from every layer's paged tensor, undoes RoPE
at the tokens' absolute positions, encodes them with :class:`kvtc.codec.Codec` and puts the blob in the
store under the vLLM prefix-cache hash of the chunk's last block (a hash chains over the whole prefix, so
identical prefixes share one entry across requests and engine restarts).

Load path: the scheduler offers the longest run of stored chunks that follows the engine's own prefix-cache
hit (never the whole prompt); the worker decodes those chunks in ``start_load_kv``, re-applies RoPE, casts
to the cache dtype and writes the slots before the forward. A missing, corrupt or mismatched blob is
reported through ``get_block_ids_with_load_errors`` so that vLLM recomputes those tokens
(``kv_load_failure_policy="recompute"``); nothing that failed to decode is ever served.

The connector reaches vLLM only through the connector API and public configuration: no patching.
Configuration (``kv_connector_extra_config``), see :class:`ConnectorConfig`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...calibration import Calibration
from ...codec import Codec
from ...errors import KVTCError, LayoutError
from ...layout import KVLayout, KVSlice
from ...rope import RopeSpec
from ...store import Store, open_store
from .paged import PagedLayout, probe_writer, slots_for

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvtc.vllm")

#: Defaults of `ConnectorConfig`, named once.
DEFAULT_RATIO = 16.0
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_STORE = "file://" + os.path.join(os.path.expanduser("~"), ".cache", "kvtc", "vllm")
#: Attention sinks kept uncompressed at the start of a sequence (paper: s = 4); later chunks have none.
DEFAULT_SINKS = 4
#: Keys remembered as already stored by this engine, so that one prefix is not encoded twice.
SUBMITTED_MEMORY = 65536

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` may set.

    ``codec``: ``"kvtc"`` (transform coding, needs ``calibration``) or ``"identity"`` (raw keys and values
    through the same path, for debugging). ``ratio``: target compression ratio of the kvtc codec.
    ``store``: a :func:`kvtc.store.open_store` URL; use ``file://`` or ``redis://`` (a ``memory://`` store is
    private to each process, and vLLM's scheduler and workers are separate processes).
    ``chunk_tokens``: tokens per stored entry, a multiple of the engine's block size.
    ``sinks``: leading tokens of a sequence kept uncompressed.
    """

    codec: str = "kvtc"
    calibration: str | None = None
    ratio: float = DEFAULT_RATIO
    store: str = DEFAULT_STORE
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    sinks: int = DEFAULT_SINKS

    def __post_init__(self) -> None:
        if self.codec not in ("kvtc", "identity"):
            raise KVTCError(f"kv_connector_extra_config: codec must be 'kvtc' or 'identity', got {self.codec!r}")
        if self.codec == "kvtc" and not self.calibration:
            raise KVTCError(
                "kv_connector_extra_config: the kvtc codec needs 'calibration' (a calibration file made by "
                "`kvtc calibrate`); use codec='identity' to store raw KV"
            )
        if self.chunk_tokens <= 0 or self.ratio <= 1 or self.sinks < 0:
            raise KVTCError("kv_connector_extra_config: chunk_tokens > 0, ratio > 1 and sinks >= 0 are required")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {"codec", "calibration", "ratio", "store", "chunk_tokens", "sinks"}
        unknown = set(extra) - known
        if unknown:
            raise KVTCError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        for name, typ in (("ratio", float), ("chunk_tokens", int), ("sinks", int)):
            if name in extra:
                extra[name] = typ(extra[name])
        return cls(**extra)

    def tag(self, calibration_hash: str) -> str:
        if self.codec == "identity":
            return "identity"
        return f"kvtc-{calibration_hash[:16]}-r{self.ratio:g}-s{self.sinks}"


# ---------------------------------------------------------------------------------------------- metadata


@dataclass
class LoadJob:
    """Restore tokens ``start..stop-1`` of request ``req_id`` from the chunks named by ``keys``."""

    req_id: str
    block_ids: list[int]
    start: int
    stop: int
    keys: list[str]  # one per chunk, chunk i covering tokens [first_chunk + i) * chunk_tokens
    first_chunk: int


@dataclass
class StoreJob:
    """Encode chunk ``chunk`` (tokens ``chunk * chunk_tokens`` onwards) of ``req_id`` under ``key``."""

    req_id: str
    key: str
    chunk: int
    block_ids: list[int]


@dataclass
class KVTCConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- connector


class KVTCConnector(KVConnectorBase_V1):
    """vLLM V1 connector: store compressed prefix chunks after each step, restore them on a prefix hit."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning(
                "KVTCConnector: kv_load_failure_policy=%r makes a request fail when a stored chunk is missing "
                "or corrupt; set kv_load_failure_policy='recompute' to recompute it instead",
                ktc.kv_load_failure_policy,
            )
        cache = vllm_config.cache_config
        self.block_size = int(cache.block_size)
        if self.config.chunk_tokens % self.block_size:
            raise KVTCError(
                f"chunk_tokens={self.config.chunk_tokens} must be a multiple of the KV block size {self.block_size}"
            )
        self.chunk = self.config.chunk_tokens
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        if int(parallel.pipeline_parallel_size) != 1:
            raise KVTCError("KVTCConnector does not support pipeline parallelism yet")
        model = vllm_config.model_config
        self.total_kv_heads = int(model.get_total_num_kv_heads())
        self.head_dim = int(model.get_head_size())
        self._codecs = _Codecs(self.config, model.hf_config)
        hash_algo = getattr(cache, "prefix_caching_hash_algo", "sha256")
        ident = f"{model.model}|{model.dtype}|{self.config.tag(self._codecs.calibration_hash)}|{hash_algo}"
        self.model_id = os.path.basename(str(model.model).rstrip("/")) or "model"
        self._namespace_base = (
            f"vllm:{self.model_id}:{hashlib.sha256(ident.encode()).hexdigest()[:16]}:c{self.chunk}"
        )
        self.scheduler = _SchedulerSide(self) if role == KVConnectorRole.SCHEDULER else None
        self.worker = _WorkerSide(self) if role == KVConnectorRole.WORKER else None

    def namespace(self, rank: int) -> str:
        return f"{self._namespace_base}:tp{rank}of{self.tp_size}"

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id)
        return False, None

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTCConnectorMetadata)
        self.worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv restores every layer before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saving happens after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTCConnectorMetadata)
        self.worker.save(meta.stores)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.close()


# ---------------------------------------------------------------------------------------------- codecs


class _Codecs:
    """The codecs for stored chunks: the first chunk of a sequence keeps its sinks, later chunks code every token."""

    def __init__(self, config: ConnectorConfig, hf_config: Any) -> None:
        self.config = config
        self.rope = RopeSpec.from_hf_config(hf_config)
        self.calibration: Calibration | None = None
        self.calibration_hash = "none"
        if config.codec == "kvtc":
            self.calibration = Calibration.load(config.calibration)
            self.calibration_hash = self.calibration.hash
        self._by_layout: dict[tuple[KVLayout, bool], Codec] = {}

    def codec(self, layout: KVLayout, first_chunk: bool) -> Codec:
        key = (layout, first_chunk)
        if key not in self._by_layout:
            if self.calibration is None:
                self._by_layout[key] = Codec.identity()
            else:
                calib = self.calibration
                if layout.heads != calib.layout.heads:
                    calib = calib.shard(layout.heads)  # tensor parallelism: this rank's heads only
                calib.check_model(layout, self.rope, model="the served model")
                sinks = self.config.sinks if first_chunk else 0
                self._by_layout[key] = Codec(calib, ratio=self.config.ratio, sinks=sinks, window=0)
        return self._by_layout[key]

    @property
    def post_rope(self) -> bool:
        """Identity entries hold the cache's own post-RoPE keys (bit-exact, no rotation round trip); kvtc
        entries hold pre-RoPE keys, the basis the calibration was fitted on."""
        return self.config.codec == "identity"

    def dtype(self, cache_dtype: torch.dtype) -> str:
        """Element type of the stored slices: the cache's own float type for identity coding (fp8 caches are
        dequantized to float32), bf16 for the transform codec."""
        if self.config.codec != "identity":
            return "bfloat16"
        return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(cache_dtype, "float32")


# ---------------------------------------------------------------------------------------------- scheduler


@dataclass
class _ReqState:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0
    load: LoadJob | None = None


class _SchedulerSide:
    def __init__(self, conn: KVTCConnector) -> None:
        self.conn = conn
        self.stores = [open_store(conn.config.store, conn.namespace(r)) for r in range(conn.tp_size)]
        self.reqs: dict[str, _ReqState] = {}
        self.hits: dict[str, tuple[int, list[str]]] = {}  # req_id -> (hit end token, chunk keys from chunk 0)
        self.submitted: OrderedDict[str, None] = OrderedDict()
        self.loaded_tokens = 0

    def close(self) -> None:
        for s in self.stores:
            s.close()

    def chunk_key(self, request: Any, chunk: int) -> str | None:
        """Store key of chunk ``chunk`` of ``request``: the hash of its last block, hex (None: not hashed yet)."""
        hashes = request.block_hashes
        if not hashes:
            return None
        # One hash per block (single KV-cache group: vLLM's hash block size is the block size).
        idx = (chunk + 1) * self.conn.chunk // self.conn.block_size - 1
        if idx >= len(hashes):
            return None
        h = hashes[idx]
        return bytes(h).hex() if isinstance(h, (bytes, bytearray)) else str(h)

    def stored(self, key: str) -> bool:
        return all(s.contains(key) for s in self.stores)

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        if request.sampling_params is None or getattr(request, "mm_features", None):
            return 0  # pooling and multimodal requests are not cached by this connector
        max_chunks = (request.num_tokens - 1) // self.conn.chunk  # at least one token left to compute
        first = num_computed_tokens // self.conn.chunk
        keys: list[str] = []
        end = first
        for c in range(first, max_chunks):
            key = self.chunk_key(request, c)
            if key is None or not self.stored(key):
                break
            keys.append(key)
            end = c + 1
        hit = end * self.conn.chunk
        if hit <= num_computed_tokens:
            self.hits.pop(request.request_id, None)
            return 0
        self.hits[request.request_id] = (hit, keys)
        return hit - num_computed_tokens

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self.reqs.setdefault(request.request_id, _ReqState(request))
        state.request = request
        hit = self.hits.pop(request.request_id, None)
        if num_external_tokens <= 0 or hit is None:
            return
        end, keys = hit
        start = end - num_external_tokens
        first = start // self.conn.chunk
        keys = keys[len(keys) - (end // self.conn.chunk - first) :]
        state.load = LoadJob(
            req_id=request.request_id,
            block_ids=list(blocks.get_block_ids()[0]),
            start=start,
            stop=end,
            keys=keys,
            first_chunk=first,
        )
        state.next_chunk = max(state.next_chunk, end // self.conn.chunk)
        self.loaded_tokens += num_external_tokens

    def build(self, out: Any) -> KVTCConnectorMetadata:
        meta = KVTCConnectorMetadata()
        computed: dict[str, int] = {}
        for data in out.scheduled_new_reqs:
            state = self.reqs.get(data.req_id)
            if state is None:
                continue
            state.block_ids = list(data.block_ids[0])
            computed[data.req_id] = data.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.reqs.get(req_id)
            if state is None:
                continue
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new[0]) if new is not None else []
            elif new is not None:
                state.block_ids.extend(new[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed.items():
            state = self.reqs[req_id]
            if state.load is not None:
                meta.loads.append(state.load)
                state.load = None
            done = before + out.num_scheduled_tokens.get(req_id, 0)
            while (state.next_chunk + 1) * self.conn.chunk <= done:
                c = state.next_chunk
                key = self.chunk_key(state.request, c)
                if key is None:
                    break
                state.next_chunk += 1
                if key in self.submitted or self.stored(key):
                    continue
                self.submitted[key] = None
                if len(self.submitted) > SUBMITTED_MEMORY:
                    self.submitted.popitem(last=False)
                n_blocks = (c + 1) * self.conn.chunk // self.conn.block_size
                meta.stores.append(StoreJob(req_id, key, c, state.block_ids[:n_blocks]))
        return meta

    def finished(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)
        self.hits.pop(req_id, None)


# ---------------------------------------------------------------------------------------------- worker


@dataclass
class _Layer:
    name: str
    index: int
    cache: torch.Tensor
    paged: PagedLayout
    k_scale: float
    v_scale: float


class _WorkerSide:
    def __init__(self, conn: KVTCConnector) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.conn = conn
        self.rank = int(get_tensor_model_parallel_rank()) if conn.tp_size > 1 else 0
        total, tp = conn.total_kv_heads, conn.tp_size
        if total >= tp:
            per = total // tp
            self.heads = tuple(range(self.rank * per, (self.rank + 1) * per))
        else:  # heads replicated across ranks
            self.heads = (self.rank * total // tp,)
        self.store: Store = open_store(conn.config.store, conn.namespace(self.rank))
        self.layers: list[_Layer] = []
        self.layout: KVLayout | None = None
        self.load_errors: set[int] = set()
        self.failed_reqs: set[str] = set()
        self.verified = False

    def close(self) -> None:
        self.store.close()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        vcfg = self.conn._vllm_config
        modules = get_layers_from_vllm_config(vcfg, AttentionLayerBase, list(kv_caches))
        cache_dtype = str(vcfg.cache_config.cache_dtype)
        layers = []
        for name, cache in kv_caches.items():
            m = _LAYER_INDEX.search(name)
            if m is None:
                raise LayoutError(f"cannot read a layer index from vLLM layer name {name!r}")
            module = modules.get(name)
            backend = module.get_attn_backend().get_name() if module is not None else "CPU_ATTN"
            paged = PagedLayout.for_backend(backend, cache, len(self.heads), self.conn.head_dim, cache_dtype)
            layers.append(
                _Layer(
                    name, int(m.group(1)), cache, paged,
                    float(getattr(module, "_k_scale_float", 1.0)), float(getattr(module, "_v_scale_float", 1.0)),
                )
            )
        layers.sort(key=lambda x: x.index)
        self.layers = layers
        self.modules = modules
        self.layout = KVLayout(
            layers=tuple(x.index for x in layers),
            num_kv_heads=self.conn.total_kv_heads,
            head_dim=self.conn.head_dim,
            heads=self.heads,
            dtype=self.conn._codecs.dtype(torch.float32 if layers[0].paged.fp8_dtype else layers[0].cache.dtype),
        )
        logger.info(
            "KVTCConnector: %d layers, heads %s of %d, %s split, chunk %d tokens, store namespace %s",
            len(layers), self.heads, self.conn.total_kv_heads, layers[0].paged.split, self.conn.chunk,
            self.conn.namespace(self.rank),
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
                    impl.do_kv_cache_update(module, k, v, cache, slots)

                probed[sig] = probe_writer(layer.cache, write, len(self.heads), self.conn.head_dim, layer.cache.dtype)
            layer.paged = probed[sig]

    # -- load ----------------------------------------------------------------------------------
    def load(self, jobs: list[LoadJob]) -> None:
        if not jobs:
            return
        self._verify()
        clock = _Timings()
        for job in jobs:
            try:
                self._load_one(job, clock)
            except Exception as e:  # noqa: BLE001 - any failure means "recompute", never "serve"
                logger.warning("KVTCConnector: restoring %s failed: %s", job.req_id, e)
                self.failed_reqs.add(job.req_id)
        logger.debug("KVTCConnector: restored %s", clock)

    def _load_one(self, job: LoadJob, clock: _Timings) -> None:
        chunk, bs = self.conn.chunk, self.conn.block_size
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
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
                bad = job.block_ids[lo // bs : (job.stop + bs - 1) // bs]
                self.load_errors.update(bad)
                self.failed_reqs.add(job.req_id)
                logger.warning(
                    "KVTCConnector: chunk %d of request %s (tokens %d..%d, key %s…) cannot be restored (%s); "
                    "vLLM will recompute it",
                    c, job.req_id, lo, job.stop, key[:16], e,
                )
                break
            off = lo - c * chunk
            parts.append((lo, hi, keys[off : off + hi - lo], values[off : off + hi - lo]))
        if not parts:
            return
        with clock("write"):
            lo, hi = parts[0][0], parts[-1][1]
            keys = torch.cat([p[2] for p in parts]) if len(parts) > 1 else parts[0][2]
            values = torch.cat([p[3] for p in parts]) if len(parts) > 1 else parts[0][3]
            slots = slots_for(job.block_ids, bs, lo, hi)
            index = _SharedIndex(slots)
            for li, layer in enumerate(self.layers):
                layer.paged.scatter(layer.cache, slots, keys[:, li], values[:, li], layer.k_scale, layer.v_scale,
                                    index=index(layer))
        clock.tokens += hi - lo

    def _decode(self, blob: bytes, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE keys and values ``[chunk_tokens, layers, heads, head_dim]`` of stored chunk ``chunk``."""
        assert self.layout is not None
        codecs = self.conn._codecs
        kv = codecs.codec(self.layout, chunk == 0).decode(blob)
        n = self.conn.chunk
        if kv.layout != self.layout:
            raise LayoutError(f"blob holds layout {kv.layout}, expected {self.layout}")
        if kv.positions.shape != (1, n) or not torch.equal(
            kv.positions[0], torch.arange(chunk * n, (chunk + 1) * n, dtype=torch.int64)
        ):
            raise LayoutError("blob holds other token positions than the chunk it is stored under")
        if codecs.post_rope:
            return kv.keys[0], kv.values[0]
        keys = codecs.rope.apply(kv.keys.float(), kv.positions, self.layout.layers)[0]
        return keys, kv.values[0]

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # -- save ----------------------------------------------------------------------------------
    def save(self, jobs: list[StoreJob]) -> None:
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
                    self.store.put(job.key, blob)
                clock.tokens += self.conn.chunk
                clock.bytes += len(blob)
            except Exception as e:  # noqa: BLE001 - a failed save is only a future cache miss
                logger.warning("KVTCConnector: storing chunk %d of %s failed: %s", job.chunk, job.req_id, e)
        logger.debug("KVTCConnector: stored %s", clock)

    def _encode(self, job: StoreJob, clock: _Timings) -> bytes:
        assert self.layout is not None
        n, bs = self.conn.chunk, self.conn.block_size
        codecs = self.conn._codecs
        dt = self.layout.torch_dtype
        with clock("read"):
            slots = slots_for(job.block_ids, bs, job.chunk * n, (job.chunk + 1) * n)
            ks, vs = [], []
            index = _SharedIndex(slots)
            for layer in self.layers:
                k, v = layer.paged.gather(layer.cache, slots, layer.k_scale, layer.v_scale,
                                          dtype=dt if codecs.post_rope else torch.float32, index=index(layer))
                ks.append(k)
                vs.append(v)
            positions = torch.arange(job.chunk * n, (job.chunk + 1) * n, dtype=torch.int64)[None]
            keys = torch.stack(ks, dim=1)[None]  # [1, tokens, layers, heads, head_dim]
            values = torch.stack(vs, dim=1)[None]
        with clock("encode"):
            if not codecs.post_rope:
                keys = codecs.rope.invert(keys, positions, self.layout.layers)
            kv = KVSlice(self.layout, keys.to(dt), values.to(dt), positions, model_id=self.conn.model_id)
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


class _Timings:
    """Seconds spent per stage of one step's loads or saves (logged at DEBUG level)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.tokens = 0
        self.bytes = 0
        self._t0 = time.perf_counter()

    def __call__(self, stage: str) -> _Stage:
        return _Stage(self, stage)

    def __str__(self) -> str:
        stages = ", ".join(f"{k} {v:.3f}" for k, v in self.seconds.items())
        size = f", {self.bytes} bytes" if self.bytes else ""
        return f"{self.tokens} tokens in {time.perf_counter() - self._t0:.3f} s ({stages}{size})"


class _Stage:
    def __init__(self, timings: _Timings, stage: str) -> None:
        self.timings, self.stage = timings, stage

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timings.seconds[self.stage] = self.timings.seconds.get(self.stage, 0.0) + time.perf_counter() - self.t0
