"""In-process LRU store: ``memory://?max_bytes=256MiB`` (default budget 1 GiB).

Entries live in this process only and vanish with it. The bytes never leave the process, so they
are kept without an envelope; a handle serves exactly one namespace. The budget counts payload
bytes; an entry larger than the whole budget is not stored (``put`` returns False).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .base import Store, _name_bytes, _payload_bytes

#: Budget of a ``memory://`` URL without ``max_bytes``.
DEFAULT_MEMORY_MAX_BYTES = 1 << 30


class MemoryStore(Store):
    """Thread-safe least-recently-used dict of bytes, bounded by `max_bytes`."""

    def __init__(self, namespace: str, max_bytes: int = DEFAULT_MEMORY_MAX_BYTES) -> None:
        super().__init__(namespace)
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def put(self, key: str, value: bytes) -> bool:
        _name_bytes("key", key)
        data = bytes(_payload_bytes(value))
        if len(data) > self.max_bytes:
            self._warn(
                "too-large",
                "kvtc.store: entry of %d bytes exceeds memory budget %d; not stored",
                len(data),
                self.max_bytes,
            )
            return False
        evicted = 0
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._held -= len(old)
            while self._held + len(data) > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._held -= len(dropped)
                evicted += 1
            self._entries[key] = data
            self._held += len(data)
            held = self._held
        with self._stats_lock:
            self._stats["puts"] += 1
            self._stats["evictions"] += evicted
            self._stats["bytes"] = held
        return True

    def get(self, key: str) -> bytes | None:
        _name_bytes("key", key)
        with self._lock:
            data = self._entries.get(key)
            if data is not None:
                self._entries.move_to_end(key)
        self._count(**({"hits": 1} if data is not None else {"misses": 1}))
        return data

    def contains(self, key: str) -> bool:
        _name_bytes("key", key)
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> bool:
        _name_bytes("key", key)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._held -= len(old)
            held = self._held
        with self._stats_lock:
            self._stats["bytes"] = held
        return old is not None

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._held = 0
        with self._stats_lock:
            self._stats["bytes"] = 0
