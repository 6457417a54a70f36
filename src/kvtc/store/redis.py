"""Redis store: ``redis://[user:password@]host:port/db?ttl=3600&prefix=kvtc:&timeout=0.5``.

Each entry is one Redis string holding an envelope (see `kvtc.store.base`) under the key
``{prefix}{namespace_tag}:{entry_id}``: `namespace_tag` is 16 hex digits of a hash of the namespace
(model + calibration), so ``SCAN MATCH {prefix}{tag}:*`` finds one namespace's entries, and
`entry_id` is the hash of (namespace, key). Reads check the envelope, so an entry copied under
another namespace's key is refused, counted as corrupt and deleted.

Budget and eviction are Redis's own (``maxmemory`` and ``maxmemory-policy allkeys-lru`` on the
server); ``ttl`` (seconds) sets an expiry on every write. ``stats()["bytes"]`` is the number of
envelope bytes this handle has written, since the server's occupancy is not this client's to know.
``put_many``/``get_many`` cost one round trip each (a pipeline of SETs, one MGET).

The server going away is a cache outage, not an error: operations return misses / False, a warning
is logged (at most every 30 s) and ``stats()["errors"]`` counts them. For ``retry_interval`` seconds
(default 1) after a failure, requests are answered as misses without touching the network, so a dead
server costs the engine nothing; then the next request tries again, and hits resume as soon as the
server is back. Socket timeouts are short (``timeout``, default 0.5 s) so a hung server cannot stall
the engine for long.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import FormatError, StoreError
from .base import Store, _payload_bytes, entry_id, namespace_tag, seal, unseal

try:
    import redis as _redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the optional dependency
    _redis = None

#: Socket connect/read timeout in seconds.
DEFAULT_TIMEOUT_S = 0.5
#: Seconds a failed server is left alone before the next attempt.
DEFAULT_RETRY_INTERVAL_S = 1.0
DEFAULT_PREFIX = "kvtc:"


class RedisStore(Store):
    """Envelope-checked entries in Redis, shared by every process that opens the same server."""

    def __init__(
        self,
        namespace: str,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        *,
        username: str | None = None,
        password: str | None = None,
        ssl: bool = False,
        ttl: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_interval: float = DEFAULT_RETRY_INTERVAL_S,
    ) -> None:
        super().__init__(namespace)
        if _redis is None:
            raise StoreError("redis:// stores need redis-py: pip install 'kvtc[redis]'")
        if ttl is not None and ttl <= 0:
            raise StoreError(f"ttl must be a positive number of seconds, got {ttl}")
        self.address = f"{host}:{port}/{db}"
        self.ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self.key_prefix = f"{prefix}{namespace_tag(namespace)}:"
        self.retry_interval = retry_interval
        self._down_until = 0.0
        self._down_lock = threading.Lock()
        self._client = _redis.Redis(
            host=host,
            port=port,
            db=db,
            username=username,
            password=password,
            ssl=ssl,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )

    def redis_key(self, key: str) -> str:
        """The Redis key that holds `key`'s entry in this namespace."""
        return self.key_prefix + entry_id(self.namespace, key)

    # -- outage handling ---------------------------------------------------------------------

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, op: str, error: Exception) -> None:
        with self._down_lock:
            self._down_until = time.monotonic() + self.retry_interval
        self._count(errors=1)
        self._warn("unavailable", "kvtc.store: Redis at %s failed during %s (%s); serving misses until it "
                   "is back", self.address, op, error)

    # -- Store -------------------------------------------------------------------------------

    def put(self, key: str, value: bytes) -> bool:
        return self.put_many({key: value})[key]

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[key]

    def put_many(self, items: Mapping[str, bytes]) -> dict[str, bool]:
        blobs = {key: seal(self.namespace, key, _payload_bytes(value)) for key, value in items.items()}
        if not blobs:
            return {}
        if not self._available():
            self._count(errors=len(blobs))
            return dict.fromkeys(blobs, False)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, blob in blobs.items():
                pipe.set(self.redis_key(key), blob, px=self.ttl_ms)
            replies = pipe.execute(raise_on_error=False)
        except (_redis.RedisError, OSError) as e:
            self._failed("put", e)
            return dict.fromkeys(blobs, False)
        out: dict[str, bool] = {}
        for (key, blob), reply in zip(blobs.items(), replies):
            ok = reply is True
            out[key] = ok
            if ok:
                self._count(puts=1, bytes=len(blob))
            else:  # e.g. OOM: the server refuses writes above maxmemory with noeviction
                self._count(errors=1)
                self._warn("put-refused", "kvtc.store: Redis at %s refused a write: %s", self.address, reply)
        return out

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        names = {key: self.redis_key(key) for key in keys}
        if not names:
            return {}
        if not self._available():
            self._count(misses=len(names), errors=len(names))
            return dict.fromkeys(names)
        try:
            blobs = self._client.mget(list(names.values()))
        except (_redis.RedisError, OSError) as e:
            self._failed("get", e)
            self._count(misses=len(names))
            return dict.fromkeys(names)
        out: dict[str, bytes | None] = {}
        bad: list[tuple[str, Any]] = []
        for (key, name), blob in zip(names.items(), blobs):
            if blob is None:
                out[key] = None
                self._count(misses=1)
                continue
            try:
                out[key] = unseal(self.namespace, key, blob)
                self._count(hits=1)
            except FormatError as e:
                out[key] = None
                self._count(misses=1, corrupt=1)
                self._warn("corrupt", "kvtc.store: removed bad Redis entry %s: %s", name, e)
                bad.append((name, blob))
        for name, blob in bad:
            self._delete_if_unchanged(name, blob)
        return out

    def _delete_if_unchanged(self, name: str, blob: Any) -> None:
        # Compare-and-delete, so that a good entry written meanwhile by another client survives.
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.watch(name)
                if pipe.get(name) == blob:
                    pipe.multi()
                    pipe.delete(name)
                    pipe.execute()
        except _redis.WatchError:
            pass
        except (_redis.RedisError, OSError) as e:
            self._failed("delete", e)

    def contains(self, key: str) -> bool:
        if not self._available():
            return False
        try:
            return bool(self._client.exists(self.redis_key(key)))
        except (_redis.RedisError, OSError) as e:
            self._failed("contains", e)
            return False

    def delete(self, key: str) -> bool:
        if not self._available():
            self._count(errors=1)
            return False
        try:
            return bool(self._client.delete(self.redis_key(key)))
        except (_redis.RedisError, OSError) as e:
            self._failed("delete", e)
            return False

    def clear(self) -> int:
        """Delete every entry of this namespace (under this prefix); returns how many were removed."""
        removed = 0
        try:
            batch: list[str] = []
            for name in self._client.scan_iter(match=_glob_escape(self.key_prefix) + "*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    removed += self._client.delete(*batch)
                    batch = []
            if batch:
                removed += self._client.delete(*batch)
        except (_redis.RedisError, OSError) as e:
            self._failed("clear", e)
        return removed

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.address!r}, namespace={self.namespace!r}, prefix={self.key_prefix!r})"


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
