"""Scheduler side of the connector: which stored chunks a request can restore, and which chunks to store.

Runs in vLLM's scheduler process. It offers the longest run of stored chunks that follows the engine's own
prefix-cache hit (never the whole prompt), as an asynchronous load: vLLM allocates the blocks of every KV-cache
group and holds the request until a worker reports the load done (or failed: the request is then recomputed and
the entries that failed are not offered again). It remembers the blocks each request was given, and each step
tells the workers (:class:`KVTCConnectorMetadata`) which chunks to restore and which newly completed chunks to
store. It never touches KV: it only asks the store which keys exist.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ...store import Store
from .config import ConnectorSetup
from .groups import CacheGroup
from .metadata import KVTCConnectorMetadata, KVTCWorkerMetadata, LoadJob, StoreJob
from .paged import NULL_BLOCK

#: Keys remembered as already stored by this engine, so that one prefix is not encoded twice.
SUBMITTED_MEMORY = 65536
#: Keys remembered as unusable (found missing or damaged by a worker), never offered again by this engine.
BAD_MEMORY = 65536


@dataclass
class _ReqState:
    request: Any
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    next_chunk: int = 0
    load: LoadJob | None = None


class SchedulerSide:
    """Request bookkeeping of the scheduler; ``stores`` holds one store per tensor-parallel rank (a chunk
    counts as stored only when every rank holds its shard)."""

    def __init__(self, setup: ConnectorSetup, stores: list[Store]) -> None:
        assert len(stores) == setup.tp_size, "one store per tensor-parallel rank"
        self.chunk = setup.chunk
        self.groups: tuple[CacheGroup, ...] = setup.groups or (CacheGroup(setup.block_size),)
        self.hash_block = setup.hash_block_size or setup.block_size
        self.stores = stores
        self.reqs: dict[str, _ReqState] = {}
        self.hits: dict[str, tuple[int, list[str]]] = {}  # req_id -> (hit end token, chunk keys from chunk 0)
        self.submitted: OrderedDict[str, None] = OrderedDict()
        self.bad: OrderedDict[str, None] = OrderedDict()
        self.loading: dict[str, list[str]] = {}  # req_id -> keys its load is restoring
        self.loading_keys: Counter[str] = Counter()

    def close(self) -> None:
        for s in self.stores:
            s.close()

    def chunk_key(self, request: Any, chunk: int) -> str | None:
        """Store key of chunk ``chunk`` of ``request``: the prefix-cache hash of its last tokens, hex (None: not
        hashed yet). The hash chains over the whole prefix, so it names the chunk and everything before it."""
        hashes = request.block_hashes
        if not hashes:
            return None
        idx = (chunk + 1) * self.chunk // self.hash_block - 1
        if idx >= len(hashes):
            return None
        h = hashes[idx]
        return bytes(h).hex() if isinstance(h, (bytes, bytearray)) else str(h)

    def stored(self, key: str) -> bool:
        return key not in self.bad and all(s.contains(key) for s in self.stores)

    def matched(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that stored chunks can provide (``get_num_new_matched_tokens``);
        None (ask again later) while another request's load is restoring some of them: once it is done, vLLM's
        own prefix cache holds those tokens and they are not decoded twice."""
        if request.sampling_params is None or getattr(request, "mm_features", None):
            return 0  # pooling and multimodal requests are not cached by this connector
        max_chunks = (request.num_tokens - 1) // self.chunk  # at least one token left to compute
        first = num_computed_tokens // self.chunk
        keys: list[str] = []
        end = first
        for c in range(first, max_chunks):
            key = self.chunk_key(request, c)
            if key is not None and self.loading_keys[key] > 0:
                self.hits.pop(request.request_id, None)
                return None
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
        """Plan the restore of the offered tokens into the blocks vLLM allocated (``update_state_after_alloc``;
        called again with no external tokens when the request is scheduled after its load)."""
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
            block_ids=[list(b) for b in blocks.get_block_ids()],
            start=start,
            stop=end,
            keys=keys,
            first_chunk=first,
        )
        state.next_chunk = end // self.chunk
        self._loaded(request.request_id)
        self.loading[request.request_id] = keys
        self.loading_keys.update(keys)

    def _loaded(self, req_id: str) -> None:
        keys = self.loading.pop(req_id, None)
        if keys:
            self.loading_keys.subtract(keys)
            for key in keys:
                if self.loading_keys[key] <= 0:
                    del self.loading_keys[key]

    def build(self, out: Any) -> KVTCConnectorMetadata:
        """This step's restores and stores (``build_connector_meta``)."""
        meta = KVTCConnectorMetadata()
        for state in self.reqs.values():  # loads of requests vLLM now holds until the load is reported done
            if state.load is not None:
                meta.loads.append(state.load)
                state.load = None
        computed: dict[str, int] = {}
        for data in out.scheduled_new_reqs:
            state = self.reqs.get(data.req_id)
            if state is None:
                continue
            state.block_ids = [list(b) for b in data.block_ids]
            computed[data.req_id] = data.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.reqs.get(req_id)
            if state is None:
                continue
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(b) for b in new] if new is not None else []
            elif new is not None:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new]
                for have, more in zip(state.block_ids, new):
                    have.extend(more)
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed.items():
            done = before + out.num_scheduled_tokens.get(req_id, 0)
            self._plan_stores(req_id, self.reqs[req_id], done, meta.stores)
        return meta

    def _storable(self, state: _ReqState, chunk: int) -> bool:
        """Whether every group still holds the blocks of ``chunk`` that its layers keep (a sliding-window group
        drops blocks that left the window, e.g. those before a prefix-cache hit)."""
        end = (chunk + 1) * self.chunk
        if len(state.block_ids) != len(self.groups):
            return False
        for group, ids in zip(self.groups, state.block_ids):
            first = end - min(group.held or self.chunk, self.chunk)  # the chunk's tokens this group keeps
            lo, hi = first // group.block_size, (end - 1) // group.block_size
            if len(ids) <= hi or NULL_BLOCK in ids[lo : hi + 1]:
                return False
        return True

    def _plan_stores(self, req_id: str, state: _ReqState, done: int, stores: list[StoreJob]) -> None:
        """Store jobs for the chunks of ``req_id`` that are complete once ``done`` tokens are computed."""
        while (state.next_chunk + 1) * self.chunk <= done:
            c = state.next_chunk
            key = self.chunk_key(state.request, c)
            if key is None:
                break
            state.next_chunk += 1
            if key in self.submitted or self.stored(key) or not self._storable(state, c):
                continue
            self.submitted[key] = None
            if len(self.submitted) > SUBMITTED_MEMORY:
                self.submitted.popitem(last=False)
            self.bad.pop(key, None)  # stored again from this engine's own KV
            end = (c + 1) * self.chunk
            ids = [b[: (end + g.block_size - 1) // g.block_size] for g, b in zip(self.groups, state.block_ids)]
            tokens = [int(t) for t in state.request.all_token_ids[c * self.chunk : end]]
            stores.append(StoreJob(req_id, key, c, ids, tokens))

    def worker_report(self, meta: KVTCWorkerMetadata | None, done_loads: set[str], failed_loads: set[str]) -> None:
        """What the workers reported this step (``update_connector_output``): entries that could not be restored
        are not offered again; chunks that were not stored may be submitted again; a request whose load failed
        is recomputed by vLLM from its first token, so its chunks are considered for storing again."""
        for req_id in done_loads:
            self._loaded(req_id)
        if meta is not None:
            for key in meta.bad_keys:
                self.bad[key] = None
                self.submitted.pop(key, None)
            while len(self.bad) > BAD_MEMORY:
                self.bad.popitem(last=False)
            for key in meta.unsaved:
                self.submitted.pop(key, None)
        for req_id in failed_loads:
            state = self.reqs.get(req_id)
            if state is not None:
                state.next_chunk = 0
                state.load = None

    def finished(self, req_id: str) -> None:
        self._loaded(req_id)
        self.reqs.pop(req_id, None)
        self.hits.pop(req_id, None)
