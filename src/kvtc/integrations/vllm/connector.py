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
Configuration (``kv_connector_extra_config``), see :class:`~.config.ConnectorConfig`; it is checked when the
engine starts (every key, the store URL, the calibration against the model and the ratio), so a misconfigured
engine does not start instead of serving without its cache.

This module is the facade vLLM loads (``kv_connector_module_path``); the halves live in :mod:`.scheduler`
(scheduler process) and :mod:`.worker` (each worker process), configured by :mod:`.config` and :mod:`.codecs`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from .codecs import Codecs
from .config import ConnectorConfig, ConnectorSetup, open_connector_store
from .metadata import KVTCConnectorMetadata, LoadJob, StoreJob
from .scheduler import SchedulerSide
from .worker import WorkerSide, worker_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvtc.vllm")


class KVTCConnector(KVConnectorBase_V1):
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
        codecs = Codecs.for_model(self.config, model.hf_config, model=f"the served model {str(model.model)!r}")
        self.setup = ConnectorSetup.from_vllm(self.config, vllm_config, codecs.calibration_hash)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            stores = [open_connector_store(self.config, self.setup.namespace(r)) for r in range(self.setup.tp_size)]
            self.scheduler = SchedulerSide(self.setup, stores)
        elif role == KVConnectorRole.WORKER:
            rank = worker_rank(self.setup.tp_size)
            store = open_connector_store(self.config, self.setup.namespace(rank))
            self.worker = WorkerSide(self.setup, codecs, rank, store, vllm_config)

    def namespace(self, rank: int) -> str:
        return self.setup.namespace(rank)

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
        self.worker.load(self._metadata().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv restores every layer before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saving happens after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.save(self._metadata().stores)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.close()

    def _metadata(self) -> KVTCConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTCConnectorMetadata)
        return meta


__all__ = ["ConnectorConfig", "KVTCConnector", "KVTCConnectorMetadata", "LoadJob", "StoreJob"]
