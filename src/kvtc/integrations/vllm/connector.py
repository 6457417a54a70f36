"""`KVTCConnector`: a vLLM V1 KV connector that keeps compressed prefixes in a kvtc store.

Store path: after each forward (``wait_for_save``, plain Python, outside any compiled region) the worker
copies the request chunks that this step completed out of every layer's paged tensor; the worker's codec process
(:mod:`.helper`) then undoes RoPE at the tokens' absolute positions, encodes them with :class:`kvtc.codec.Codec` and
puts the blob in the store under the vLLM prefix-cache hash of the chunk's last block (a hash chains over the whole prefix, so
identical prefixes share one entry across requests and engine restarts).

Load path: the scheduler offers the longest run of stored chunks that follows the engine's own prefix-cache
hit (never the whole prompt) as an asynchronous load; the worker decodes those chunks in ``start_load_kv`` (the
second half in its codec process), re-applies RoPE, casts to the cache dtype, writes the slots and reports the request done. A missing, corrupt or
mismatched blob fails the request's load (``failed_recving``): vLLM recomputes it
(``kv_load_failure_policy="recompute"``), the scheduler stops offering the entry, and nothing that failed to
decode is ever served.

KV-cache groups: the connector declares vLLM's hybrid-allocator support (``SupportsHMA``), so a model that mixes
sliding-window and full attention keeps vLLM's hybrid KV-cache manager; each layer is restored into its own
group's blocks (see :mod:`.groups`).

The connector reaches vLLM only through the connector API and public configuration: no patching.
Configuration (``kv_connector_extra_config``), see :class:`~.config.ConnectorConfig`; it is checked when the
engine starts (every key, the store URL, the calibration against the model and the ratio), so a misconfigured
engine does not start instead of serving without its cache.

This module is the facade vLLM loads (``kv_connector_module_path``); the halves live in :mod:`.scheduler`
(scheduler process) and :mod:`.worker` (each worker process), configured by :mod:`.config` and :mod:`.codecs`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .codecs import Codecs
from .config import ConnectorConfig, ConnectorSetup, open_connector_store
from .groups import mla_refused
from .metadata import KVTCConnectorMetadata, KVTCWorkerMetadata, LoadJob, StoreJob
from .scheduler import SchedulerSide
from .stats import FIELDS
from .worker import WorkerSide, worker_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtc.vllm")


@dataclass
class KVTCStats(KVConnectorStats):
    """The counters of :data:`FIELDS` over some steps and workers (sums)."""

    def __post_init__(self) -> None:
        self.data = {name: int(self.data.get(name, 0)) for name in FIELDS}

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVTCStats:
        for name in FIELDS:
            self.data[name] += int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        tokens = self.data["stored_tokens"]
        out["stored_bytes_per_token"] = round(self.data["stored_bytes"] / tokens, 1) if tokens else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def stats_from(data: dict[str, Any] | None) -> KVTCStats:
    """:class:`KVTCStats` from a serialised payload (or empty)."""
    return KVTCStats(data=dict(data or {}))


class KVTCConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM V1 connector: store compressed prefix chunks after each step, restore them on a prefix hit.

    Construction is the startup check: the configuration is parsed, the calibration loaded and checked against
    the served model and the ratio, and the store opened; any problem is a :class:`~kvtc.errors.ConfigError`
    that stops the engine from starting.
    """

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
        model = vllm_config.model_config
        name = f"the served model {str(model.model)!r}"
        if getattr(model, "use_mla", False):
            raise mla_refused(name)
        codecs = Codecs.for_model(self.config, model.hf_config, model=name, checkpoint=str(model.model))
        self.setup = ConnectorSetup.from_vllm(self.config, vllm_config, codecs.calibration_hash, kv_cache_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            stores = [open_connector_store(self.config, self.setup.namespace(r)) for r in range(self.setup.tp_size)]
            self.scheduler = SchedulerSide(self.setup, stores)
        elif role == KVConnectorRole.WORKER:
            rank = worker_rank(self.setup.tp_size)
            store = open_connector_store(self.config, self.setup.namespace(rank))
            self.worker = WorkerSide(self.setup, codecs, rank, store, vllm_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is only a future cache miss

    def namespace(self, rank: int) -> str:
        return self.setup.namespace(rank)

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        n = self.scheduler.matched(request, num_computed_tokens)
        return n, bool(n)  # loaded between steps: vLLM holds the request until the load is reported

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is not None:
            meta = connector_output.kv_connector_worker_meta
            done = set(connector_output.finished_recving or ())
            failed = set(getattr(connector_output, "failed_recving", None) or ())
            self.scheduler.worker_report(meta if isinstance(meta, KVTCWorkerMetadata) else None, done, failed)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id)
        return False, None  # saves work on copies: the blocks may be freed at once

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.load(self._metadata().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only after its load is reported done

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saving happens after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.save(self._metadata().stores)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None:
            return KVConnectorTransferResults()
        done, failed = self.worker.take_finished_loads()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_kv_connector_stats(self) -> KVTCStats | None:
        """This worker's counters since the last call (None on the scheduler, or when nothing happened)."""
        if self.worker is None:
            return None
        stats = stats_from(self.worker.tally.take())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTCStats | None:
        return stats_from(data)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_report() if self.worker is not None else None

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.close()

    def _metadata(self) -> KVTCConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTCConnectorMetadata)
        return meta


__all__ = ["ConnectorConfig", "KVTCConnector", "KVTCConnectorMetadata", "LoadJob", "StoreJob"]
