"""What the scheduler side tells the workers each step: the chunks to restore and the chunks to store."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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
