"""Scheduler side of the connector: which stored chunks a request can restore, and which chunks to store.

Runs in vLLM's scheduler process. It offers the longest run of stored chunks that follows the engine's own
prefix-cache hit (never the whole prompt), remembers the blocks each request was given, and each step tells
the workers (:class:`KVTCConnectorMetadata`) which chunks to restore and which newly completed chunks to store.
It never touches KV: it only asks the store which keys exist.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ...store import Store
from .config import ConnectorSetup
from .metadata import KVTCConnectorMetadata, LoadJob, StoreJob

#: Keys remembered as already stored by this engine, so that one prefix is not encoded twice.
SUBMITTED_MEMORY = 65536


@dataclass
class _ReqState:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0
    load: LoadJob | None = None


class SchedulerSide:
    """Request bookkeeping of the scheduler; ``stores`` holds one store per tensor-parallel rank (a chunk
    counts as stored only when every rank holds its shard)."""

    def __init__(self, setup: ConnectorSetup, stores: list[Store]) -> None:
        assert len(stores) == setup.tp_size, "one store per tensor-parallel rank"
        self.chunk = setup.chunk
        self.block_size = setup.block_size
        self.stores = stores
        self.reqs: dict[str, _ReqState] = {}
        self.hits: dict[str, tuple[int, list[str]]] = {}  # req_id -> (hit end token, chunk keys from chunk 0)
        self.submitted: OrderedDict[str, None] = OrderedDict()

    def close(self) -> None:
        for s in self.stores:
            s.close()

    def chunk_key(self, request: Any, chunk: int) -> str | None:
        """Store key of chunk ``chunk`` of ``request``: the hash of its last block, hex (None: not hashed yet)."""
        hashes = request.block_hashes
        if not hashes:
            return None
        # One hash per block (single KV-cache group: vLLM's hash block size is the block size).
        idx = (chunk + 1) * self.chunk // self.block_size - 1
        if idx >= len(hashes):
            return None
        h = hashes[idx]
        return bytes(h).hex() if isinstance(h, (bytes, bytearray)) else str(h)

    def stored(self, key: str) -> bool:
        return all(s.contains(key) for s in self.stores)

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that stored chunks can provide (``get_num_new_matched_tokens``)."""
        if request.sampling_params is None or getattr(request, "mm_features", None):
            return 0  # pooling and multimodal requests are not cached by this connector
        max_chunks = (request.num_tokens - 1) // self.chunk  # at least one token left to compute
        first = num_computed_tokens // self.chunk
        keys: list[str] = []
        end = first
        for c in range(first, max_chunks):
            key = self.chunk_key(request, c)
            if key is None or not self.stored(key):
                break
            keys.append(key)
            end = c + 1
        hit = end * self.chunk
        if hit <= num_computed_tokens:
            self.hits.pop(request.request_id, None)
            return 0
        self.hits[request.request_id] = (hit, keys)
        return hit - num_computed_tokens

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the restore of the offered tokens into the blocks vLLM allocated (``update_state_after_alloc``)."""
        state = self.reqs.setdefault(request.request_id, _ReqState(request))
        state.request = request
        hit = self.hits.pop(request.request_id, None)
        if num_external_tokens <= 0 or hit is None:
            return
        end, keys = hit
        start = end - num_external_tokens
        first = start // self.chunk
        keys = keys[len(keys) - (end // self.chunk - first) :]
        state.load = LoadJob(
            req_id=request.request_id,
            block_ids=list(blocks.get_block_ids()[0]),
            start=start,
            stop=end,
            keys=keys,
            first_chunk=first,
        )
        state.next_chunk = max(state.next_chunk, end // self.chunk)

    def build(self, out: Any) -> KVTCConnectorMetadata:
        """This step's restores and stores (``build_connector_meta``)."""
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
            self._plan_stores(req_id, state, done, meta.stores)
        return meta

    def _plan_stores(self, req_id: str, state: _ReqState, done: int, stores: list[StoreJob]) -> None:
        """Store jobs for the chunks of ``req_id`` that are complete once ``done`` tokens are computed."""
        while (state.next_chunk + 1) * self.chunk <= done:
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
            n_blocks = (c + 1) * self.chunk // self.block_size
            stores.append(StoreJob(req_id, key, c, state.block_ids[:n_blocks]))

    def finished(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)
        self.hits.pop(req_id, None)
