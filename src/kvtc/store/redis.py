"""Redis store, one server or a Redis Cluster (Redis or Valkey):
``redis://[user:password@]host:port/db?ttl=3600&prefix=kvtc:&timeout=0.5`` or
``redis+cluster://host:7000,host:7001,host:7002?ttl=3600``.

Each entry is one Redis string holding an envelope (see `kvtc.store.base`) under the key
``{prefix}{namespace_tag}:{entry_id}``: `namespace_tag` is 16 hex digits of a hash of the namespace
(model + calibration), so ``SCAN MATCH {prefix}{tag}:*`` finds one namespace's entries, and
`entry_id` is the hash of (namespace, key). Reads check the envelope, so an entry copied under
another namespace's key is refused, counted as corrupt and deleted. The keys are the same in both
modes: a single server's entries keep their names when it becomes a cluster.

Budget and eviction are Redis's own (``maxmemory`` and ``maxmemory-policy allkeys-lru`` on each
server); ``ttl`` (seconds) sets an expiry on every write. ``stats()["bytes"]`` is the number of
envelope bytes this handle has written, since the servers' occupancy is not this client's to know.
``put_many``/``get_many`` cost one round trip per server they touch (a pipeline of SETs or GETs).

Cluster: the store routes each key to the master that serves its hash slot (`kvtc.store.redis_cluster`),
from a slot map read lazily with ``CLUSTER SLOTS`` from any node it knows (the URL's hosts, then those
the map names). A ``MOVED`` reply (resharding, failover) re-reads the map and retries those keys once.
``redis://`` names one server but detects a cluster by itself: the first ``MOVED`` reply turns on
routing. Redis Cluster serves database 0 only. Masters without replicas should run with
``cluster-require-full-coverage no``, so that the others keep serving when one is down.

Any server going away is a cache outage, not an error: its keys are misses / False, a warning is
logged (at most every 30 s per server) and ``stats()["errors"]`` counts them; keys on the other
masters keep being served. For ``retry_interval`` seconds (default 1) after a failure, requests for
that server are answered without touching the network, so a dead server costs the engine nothing;
then the next request tries again, and hits resume as soon as the server is back. Socket timeouts
are short (``timeout``, default 0.5 s) so a hung server cannot stall the engine for long. A reply
that is not what the command returns (wrong type, garbled, absurdly nested) is treated the same way:
a miss and a warning, never an exception.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import FormatError, StoreError
from .base import Store, _payload_bytes, entry_id, namespace_tag, seal, unseal
from .redis_cluster import TopologyError, check_host, check_port, key_slot, parse_cluster_slots, slot_owners

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
#: Bounds of the options (seconds): finite, so that every value converts to a socket timeout or PX.
MAX_TIMEOUT_S = 3600.0
MAX_RETRY_INTERVAL_S = 3600.0
MAX_TTL_S = 10 * 365 * 86400.0
MAX_PREFIX_BYTES = 1024
MAX_DB = 2**31 - 1
#: Least seconds between two reads of the cluster slot map (a storm of MOVED replies costs one read).
MIN_MAP_INTERVAL_S = 0.1

#: A reply slot for a key whose server could not be asked (down, failed, or no server for its slot).
_UNSERVED = object()


class _Node:
    """One server: its client and the time before which it is left alone after a failure."""

    __slots__ = ("address", "client", "down_until")

    def __init__(self, address: str, client: Any) -> None:
        self.address = address
        self.client = client
        self.down_until = 0.0


def check_options(ttl: float | None, timeout: float, retry_interval: float, prefix: str, db: int) -> None:
    """Raise `StoreError` for an option no server could honour (every URL value passes through here)."""

    def bounded(name: str, value: float, low: float, high: float, low_open: bool) -> None:
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and (low < value <= high if low_open else low <= value <= high)
        )
        if not ok:
            raise StoreError(
                f"{name} must be a number in {'(' if low_open else '['}{low:g}, {high:g}] seconds, got {value!r}"
            )

    if ttl is not None:
        bounded("ttl", ttl, 0.0, MAX_TTL_S, True)
    bounded("timeout", timeout, 0.0, MAX_TIMEOUT_S, True)
    bounded("retry_interval", retry_interval, 0.0, MAX_RETRY_INTERVAL_S, False)
    if not isinstance(prefix, str) or len(prefix.encode("utf-8", "surrogatepass")) > MAX_PREFIX_BYTES:
        raise StoreError(f"prefix must be a str of at most {MAX_PREFIX_BYTES} bytes")
    if isinstance(db, bool) or not isinstance(db, int) or not 0 <= db <= MAX_DB:
        raise StoreError(f"database must be an integer in 0..{MAX_DB}, got {db!r}")


class RedisStore(Store):
    """Envelope-checked entries in Redis or Valkey, one server or a cluster, shared by every process."""

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
        cluster: bool = False,
        nodes: Sequence[tuple[str, int]] = (),
    ) -> None:
        super().__init__(namespace)
        if _redis is None:
            raise StoreError("redis:// stores need redis-py: pip install 'kvtc[redis]'")
        check_options(ttl, timeout, retry_interval, prefix, db)
        seeds = [(check_host(h, "redis store"), check_port(p, "redis store")) for h, p in [(host, port), *nodes]]
        if (cluster or len(seeds) > 1) and db != 0:
            raise StoreError(f"a Redis Cluster serves database 0 only, not {db}")
        self.address = f"{host}:{port}/{db}" if not (cluster or nodes) else ",".join(f"{h}:{p}" for h, p in seeds)
        self.ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self.key_prefix = f"{prefix}{namespace_tag(namespace)}:"
        self.retry_interval = retry_interval
        self._db = db
        self._client_kwargs = dict(
            username=username,
            password=password,
            ssl=ssl,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )
        self._lock = threading.Lock()
        self._nodes: dict[tuple[str, int], _Node] = {}
        self._seeds = seeds
        self.cluster = bool(cluster or nodes)
        self._slots: list[_Node | None] | None = None  # cluster slot map; None until read
        self._map_version = 0
        self._next_map_read = 0.0
        self._last_map_read = -MIN_MAP_INTERVAL_S
        self._node(*seeds[0])

    def redis_key(self, key: str) -> str:
        """The Redis key that holds `key`'s entry in this namespace."""
        return self.key_prefix + entry_id(self.namespace, key)

    # -- servers -----------------------------------------------------------------------------

    def _node(self, host: str, port: int) -> _Node:
        with self._lock:
            node = self._nodes.get((host, port))
            if node is None:
                client = _redis.Redis(host=host, port=port, db=self._db, **self._client_kwargs)
                node = self._nodes[(host, port)] = _Node(f"{host}:{port}", client)
            return node

    def _failed(self, node: _Node, op: str, error: BaseException) -> None:
        node.down_until = time.monotonic() + self.retry_interval
        if self.cluster:
            with self._lock:  # a master may have failed over: read the slot map again after the pause
                self._next_map_read = self._next_map_read or node.down_until
        try:
            node.client.connection_pool.disconnect(inuse_connections=False)  # no half-read reply stays pooled
        except Exception:  # noqa: BLE001 - closing sockets of a server that misbehaves
            pass
        self._warn(
            f"unavailable:{node.address}",
            "kvtc.store: Redis at %s failed during %s (%s: %.200s); serving misses for its keys until it is back",
            node.address,
            op,
            type(error).__name__,
            error,
        )

    def _route(self, commands: Mapping[str, tuple]) -> list[tuple[_Node | None, list[str]]]:
        """Group the keys of `commands` by the server that holds them (None: no server known for it)."""
        if not self.cluster:
            return [(self._node(*self._seeds[0]), list(commands))]
        slots = self._slots
        if slots is None or (self._next_map_read and time.monotonic() >= self._next_map_read):
            self._read_map(self._map_version)
            slots = self._slots
        groups: dict[int, tuple[_Node | None, list[str]]] = {}
        for key, command in commands.items():
            node = slots[key_slot(command[1].encode())] if slots is not None else None
            groups.setdefault(id(node), (node, []))[1].append(key)
        return list(groups.values())

    def _read_map(self, seen_version: int) -> bool:
        """Read the slot map from the first node that answers well; True if it changed since `seen_version`."""
        with self._lock:
            if self._map_version != seen_version:
                return True  # another thread has just read it
            now = time.monotonic()
            recent = self._slots is not None and now - self._last_map_read < MIN_MAP_INTERVAL_S
            if recent or now < self._next_map_read:
                return False  # read moments ago, or no node answered moments ago
            self._last_map_read = now
            known = list(self._nodes)
        candidates = list(dict.fromkeys([*self._seeds, *known]))
        now = time.monotonic()
        candidates.sort(key=lambda hp: self._nodes[hp].down_until > now if hp in self._nodes else False)
        problems = []
        for host, port in candidates:
            node = self._node(host, port)
            try:
                ranges = parse_cluster_slots(node.client.execute_command("CLUSTER", "SLOTS"), host)
            except TopologyError as e:
                problems.append(f"{node.address}: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - any failure of one node: ask the next
                problems.append(f"{node.address}: {type(e).__name__}")
                continue
            masters = {(h, p): self._node(h, p) for _, _, h, p in ranges}
            slots = [None if owner is None else masters[owner] for owner in slot_owners(ranges)]
            with self._lock:
                self._slots = slots
                self._map_version += 1
                self._next_map_read = 0.0
            return True
        with self._lock:
            self._next_map_read = time.monotonic() + max(self.retry_interval, 0.05)
        self._count(errors=1)
        self._warn(
            "cluster-map",
            "kvtc.store: no Redis Cluster node of %s gave a slot map (%s); serving misses",
            self.address,
            "; ".join(problems)[:500],
        )
        return False

    def _run(self, op: str, commands: Mapping[str, tuple]) -> dict[str, Any]:
        """Send each key's command, one pipeline per server; key -> reply (or `_UNSERVED`)."""
        replies: dict[str, Any] = {}
        pending = dict(commands)
        if not pending:
            return replies
        for attempt in (0, 1):
            version = self._map_version
            moved: dict[str, tuple] = {}
            for node, keys in self._route(pending):
                for key, reply in zip(keys, self._pipeline(node, op, [pending[k] for k in keys])):
                    if isinstance(reply, _redis.exceptions.AskError):  # MOVED or ASK: another node holds it
                        moved[key] = pending[key]
                    else:
                        replies[key] = reply
            if not moved:
                break
            if attempt == 0 and self._redirected(version):
                pending = moved
                continue
            replies.update(dict.fromkeys(moved, _UNSERVED))
            self._warn(
                "moved", "kvtc.store: Redis at %s keeps redirecting %s requests; treated as misses", self.address, op
            )
        return replies

    def _redirected(self, version: int) -> bool:
        if not self.cluster:
            self.cluster = True  # a redis:// URL naming a cluster node: route by slot from now on
            self._warn(
                "detected-cluster",
                "kvtc.store: Redis at %s is a cluster node; routing keys by hash slot "
                "(name it redis+cluster:// to say so)",
                self.address,
            )
        return self._read_map(version)

    def _pipeline(self, node: _Node | None, op: str, commands: list[tuple]) -> list[Any]:
        if node is None or time.monotonic() < node.down_until:
            if node is None and self._slots is not None:
                self._warn(
                    "no-owner",
                    "kvtc.store: no Redis Cluster master serves some keys of %s; serving misses",
                    self.address,
                )
            return [_UNSERVED] * len(commands)
        try:
            pipe = node.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = pipe.execute(raise_on_error=False)
            if not isinstance(replies, list) or len(replies) != len(commands):
                raise _redis.exceptions.InvalidResponse(f"{len(commands)} commands drew {type(replies).__name__}")
        except Exception as e:  # noqa: BLE001 - a server's failure, whatever form it takes, is a cache miss
            self._failed(node, op, e)
            return [_UNSERVED] * len(commands)
        return replies

    def _unserved(self, op: str, reply: Any) -> bool:
        """True (after counting and warning) if `reply` is not an answer about the entry."""
        if reply is _UNSERVED:
            self._count(errors=1)
            return True
        if isinstance(reply, _redis.exceptions.ResponseError):
            self._count(errors=1)
            self._warn(f"{op}-refused", "kvtc.store: Redis at %s refused a %s: %.200s", self.address, op, reply)
            return True
        return False

    # -- Store -------------------------------------------------------------------------------

    def put(self, key: str, value: bytes) -> bool:
        return self.put_many({key: value})[key]

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[key]

    def put_many(self, items: Mapping[str, bytes]) -> dict[str, bool]:
        blobs = {key: seal(self.namespace, key, _payload_bytes(value)) for key, value in items.items()}
        expiry = () if self.ttl_ms is None else ("PX", self.ttl_ms)
        replies = self._run("put", {key: ("SET", self.redis_key(key), blob, *expiry) for key, blob in blobs.items()})
        out: dict[str, bool] = {}
        for key, blob in blobs.items():
            reply = replies[key]
            out[key] = ok = reply is True
            if ok:
                self._count(puts=1, bytes=len(blob))
            elif not self._unserved("put", reply):  # e.g. OOM: writes above maxmemory with noeviction
                self._count(errors=1)
                self._warn("put-odd", "kvtc.store: Redis at %s answered a write with %.100r", self.address, reply)
        return out

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        names = {key: self.redis_key(key) for key in keys}
        replies = self._run("get", {key: ("GET", name) for key, name in names.items()})
        out: dict[str, bytes | None] = {}
        for key, name in names.items():
            blob = replies[key]
            out[key] = None
            if blob is None or self._unserved("get", blob):
                self._count(misses=1)
                continue
            try:
                if not isinstance(blob, bytes):
                    raise FormatError(f"the server answered GET with {type(blob).__name__}, not a string")
                out[key] = unseal(self.namespace, key, blob)
                self._count(hits=1)
            except FormatError as e:
                self._count(misses=1, corrupt=1)
                self._warn("corrupt", "kvtc.store: removed bad Redis entry %s: %s", name, e)
                if isinstance(blob, bytes):
                    self._delete_if_unchanged(name, blob)
        return out

    def _delete_if_unchanged(self, name: str, blob: bytes) -> None:
        # Compare-and-delete, so that a good entry written meanwhile by another client survives.
        ((node, _),) = self._route({name: ("GET", name)})
        if node is None or time.monotonic() < node.down_until:
            return
        try:
            with node.client.pipeline(transaction=True) as pipe:
                pipe.watch(name)
                if pipe.get(name) == blob:
                    pipe.multi()
                    pipe.delete(name)
                    pipe.execute()
        except _redis.WatchError:
            pass
        except Exception as e:  # noqa: BLE001
            self._failed(node, "delete", e)

    def contains(self, key: str) -> bool:
        reply = self._run("contains", {key: ("EXISTS", self.redis_key(key))})[key]
        return not self._unserved("contains", reply) and _is_count(reply) and reply > 0

    def delete(self, key: str) -> bool:
        reply = self._run("delete", {key: ("DEL", self.redis_key(key))})[key]
        return not self._unserved("delete", reply) and _is_count(reply) and reply > 0

    def clear(self) -> int:
        """Delete every entry of this namespace (under this prefix) on every server; returns how many."""
        if self.cluster:
            self._route({})  # reads the slot map if there is none yet
            nodes = list({id(n): n for n in self._slots or () if n is not None}.values())
        else:
            nodes = [self._node(*self._seeds[0])]
        return sum(self._clear_node(node) for node in nodes)

    def _clear_node(self, node: _Node) -> int:
        removed = 0
        cursor: Any = 0
        pattern = _glob_escape(self.key_prefix) + "*"
        try:
            while True:
                reply = node.client.execute_command("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
                if not (
                    isinstance(reply, (list, tuple))
                    and len(reply) == 2
                    and isinstance(reply[1], list)
                    and isinstance(reply[0], (bytes, int))
                    and all(isinstance(n, bytes) for n in reply[1])
                ):
                    raise _redis.exceptions.InvalidResponse(f"SCAN answered {type(reply).__name__}")
                cursor, names = reply
                if names:  # one DEL per key: the keys of a batch may lie in different slots
                    pipe = node.client.pipeline(transaction=False)
                    for name in names:
                        pipe.delete(name)
                    removed += sum(n for n in pipe.execute(raise_on_error=False) if _is_count(n))
                if cursor in (0, b"0"):
                    return removed
        except Exception as e:  # noqa: BLE001
            self._failed(node, "clear", e)
        return removed

    def close(self) -> None:
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.client.close()

    def __repr__(self) -> str:
        kind = "cluster " if self.cluster else ""
        return f"RedisStore({kind}{self.address!r}, namespace={self.namespace!r}, prefix={self.key_prefix!r})"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
