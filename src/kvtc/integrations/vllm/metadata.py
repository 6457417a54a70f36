"""What the two halves of the connector tell each other.

Scheduler -> workers, each step (:class:`KVTCConnectorMetadata`): the chunks to restore and the chunks to store.
Workers -> scheduler, each step (:class:`KVTCWorkerMetadata`): the store keys found unusable while restoring (so
they are not offered again) and the chunks whose save was dropped or failed (so they may be submitted again).
Block ids come as one list per KV-cache group (:mod:`.groups`); a sliding-window group's list holds vLLM's null
block (0) where the group has dropped a block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadJob:
    """Restore tokens ``start..stop-1`` of request ``req_id`` from the chunks named by ``keys``."""

    req_id: str
    block_ids: list[list[int]]  # per KV-cache group
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
    block_ids: list[list[int]]  # per KV-cache group, at least up to the chunk's end
    #: the chunk's token ids (a calibration with a token map codes each token less a prediction from them)
    token_ids: list[int] = field(default_factory=list)


@dataclass
class KVTCConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)


@dataclass
class KVTCWorkerMetadata(KVConnectorWorkerMetadata):
    """``bad_keys``: entries that could not be restored (missing, damaged, of another layout); ``unsaved``: keys
    planned for storing that were not stored (dropped or failed)."""

    bad_keys: set[str] = field(default_factory=set)
    unsaved: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTCWorkerMetadata)
        return KVTCWorkerMetadata(self.bad_keys | other.bad_keys, self.unsaved | other.unsaved)

    def __bool__(self) -> bool:
        return bool(self.bad_keys or self.unsaved)
