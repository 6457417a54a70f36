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
then the next request tries again, and hits resume as soon as the server is back. A reply that is
not what the command returns (wrong type, garbled, nested or wide beyond `kvtc.store.resp`'s bounds,
a string longer than ``max_entry_bytes``) is treated the same way: a miss and a warning, never an
exception.

Time: the store speaks RESP itself (`kvtc.store.resp`). Each exchange with a server (connect, send,
the whole reply) must finish within ``timeout`` (default 0.5 s), however the server drips its bytes,
and each call (``get``, ``put_many``, ...) within ``CALL_TIMEOUTS`` x ``timeout`` in all, slot map reads
and ``MOVED`` retries included: a key whose server was not reached by then is a miss. A slot map read
asks at most `kvtc.store.redis_cluster.MAP_TRIES` nodes. ``timeout`` must therefore cover moving the
largest entry (or batch).
"""

from __future__ import annotations

import re
import ssl
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import FormatError, StoreError
from ..textsafe import printable
from .base import Store, _payload_bytes, entry_id, namespace_tag, seal, unseal
from .redis_cluster import MIN_MAP_INTERVAL_S, ClusterRouting, check_host, check_port
from .resp import Limits, ReplyError, ReplyTooLarge, RespClient, Status

#: Seconds one exchange with a server may take in all (connect, send, the whole reply).
DEFAULT_TIMEOUT_S = 0.5
#: One call (get, put, get_many, ...) takes at most this many `timeout`s, whatever the servers do.
CALL_TIMEOUTS = 2
#: Seconds a failed server is left alone before the next attempt.
DEFAULT_RETRY_INTERVAL_S = 1.0
DEFAULT_PREFIX = "kvtc:"
#: Largest entry (envelope) read or written: Redis's own default ``proto-max-bulk-len``.
DEFAULT_REDIS_MAX_ENTRY_BYTES = 512 << 20
#: Bounds of the options (seconds): finite, so that every value converts to a deadline or PX.
MAX_TIMEOUT_S = 3600.0
MAX_RETRY_INTERVAL_S = 3600.0
MAX_TTL_S = 10 * 365 * 86400.0
MAX_PREFIX_BYTES = 1024
MAX_DB = 2**31 - 1
MAX_ENTRY_LIMIT = 2**63 - 1

#: SCAN batches one clear() reads from one server at most (a billion keys at 1,000 a batch).
MAX_SCAN_BATCHES = 1_000_000

#: A reply slot for a key whose server could not be asked (down, failed, out of time, or no server for its slot).
_UNSERVED = object()


class _Node:
    """One server: its client, the time before which it is left alone after a failure, and when it last failed
    to give a slot map (0: never, or it gave one since)."""

    __slots__ = ("address", "client", "down_until", "map_failed")

    def __init__(self, address: str, client: RespClient) -> None:
        self.address = printable(address)  # the host may come from a slot map
        self.client = client
        self.down_until = 0.0
        self.map_failed = 0.0


def check_options(
    ttl: float | None, timeout: float, retry_interval: float, prefix: str, db: int, max_entry_bytes: int = 1
) -> None:
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
    if isinstance(max_entry_bytes, bool) or not isinstance(max_entry_bytes, int):
        raise StoreError(f"max_entry_bytes must be an integer, got {max_entry_bytes!r}")
    if not 1 <= max_entry_bytes <= MAX_ENTRY_LIMIT:
        raise StoreError(f"max_entry_bytes must be in 1..{MAX_ENTRY_LIMIT}, got {max_entry_bytes}")


class RedisStore(ClusterRouting, Store):
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
        max_entry_bytes: int = DEFAULT_REDIS_MAX_ENTRY_BYTES,
    ) -> None:
        super().__init__(namespace)
        check_options(ttl, timeout, retry_interval, prefix, db, max_entry_bytes)
        seeds = [(check_host(h, "redis store"), check_port(p, "redis store")) for h, p in [(host, port), *nodes]]
        if (cluster or len(seeds) > 1) and db != 0:
            raise StoreError(f"a Redis Cluster serves database 0 only, not {db}")
        self.address = f"{host}:{port}/{db}" if not (cluster or nodes) else ",".join(f"{h}:{p}" for h, p in seeds)
        self.ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self.key_prefix = f"{prefix}{namespace_tag(namespace)}:"
        self.timeout = float(timeout)
        self.retry_interval = retry_interval
        self.max_entry_bytes = max_entry_bytes
        self._db = db
        self._auth = (username, password)
        self._tls = ssl
        self._tls_context: Any = None
        self._limits = Limits(max_bulk=max_entry_bytes)
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
                if self._tls and self._tls_context is None:
                    self._tls_context = ssl.create_default_context()
                username, password = self._auth
                client = RespClient(
                    host,
                    port,
                    limits=self._limits,
                    db=self._db,
                    username=username,
                    password=password,
                    tls=self._tls_context,
                )
                node = self._nodes[(host, port)] = _Node(f"{host}:{port}", client)
            return node

    def _step(self, deadline: float) -> float:
        """The deadline of one exchange within a call that must end by `deadline`."""
        return min(deadline, time.monotonic() + self.timeout)

    def _failed(self, node: _Node, op: str, error: BaseException) -> None:
        if isinstance(error, ReplyTooLarge):  # the server works; one of its entries is larger than this store reads
            self._warn("too-large-reply", "kvtc.store: Redis at %s: %s; a miss", node.address, printable(error))
            return
        node.client.connection_pool.disconnect()  # the one that failed is closed already; the idle ones may be stale
        node.down_until = time.monotonic() + self.retry_interval
        if self.cluster:
            with self._lock:  # a master may have failed over: read the slot map again after the pause
                self._next_map_read = self._next_map_read or node.down_until
        self._warn(
            f"unavailable:{node.address}",
            "kvtc.store: Redis at %s failed during %s (%s: %s); serving misses for its keys until it is back",
            node.address,
            op,
            type(error).__name__,
            printable(error),
        )

    def _call_deadline(self) -> float:
        return time.monotonic() + CALL_TIMEOUTS * self.timeout

    def _run(self, op: str, commands: Mapping[str, tuple], deadline: float | None = None) -> dict[str, Any]:
        """Send each key's command, one pipeline per server, all before `deadline` (default: `CALL_TIMEOUTS`
        timeouts from now); key -> reply (or `_UNSERVED`)."""
        replies: dict[str, Any] = {}
        pending = dict(commands)
        if not pending:
            return replies
        deadline = self._call_deadline() if deadline is None else deadline
        for attempt in (0, 1):
            version = self._map_version
            moved: dict[str, tuple] = {}
            for node, keys in self._route(pending, deadline):
                for key, reply in zip(keys, self._pipeline(node, op, [pending[k] for k in keys], deadline)):
                    if isinstance(reply, ReplyError) and reply.redirect:  # MOVED or ASK: another node holds it
                        moved[key] = pending[key]
                    else:
                        replies[key] = reply
            if not moved:
                break
            if attempt == 0 and self._redirected(version, deadline):
                pending = moved
                continue
            replies.update(dict.fromkeys(moved, _UNSERVED))
            self._warn(
                "moved", "kvtc.store: Redis at %s keeps redirecting %s requests; treated as misses", self.address, op
            )
        return replies

    def _pipeline(self, node: _Node | None, op: str, commands: list[tuple], deadline: float) -> list[Any]:
        if node is None or time.monotonic() < node.down_until:
            if node is None and self._slots is not None:
                self._warn(
                    "no-owner",
                    "kvtc.store: no Redis Cluster master serves some keys of %s; serving misses",
                    self.address,
                )
            return [_UNSERVED] * len(commands)
        if time.monotonic() >= deadline:
            self._warn(
                "out-of-time",
                "kvtc.store: a %s on %s ran out of its %g s; serving misses for the servers not yet asked",
                op,
                self.address,
                CALL_TIMEOUTS * self.timeout,
            )
            return [_UNSERVED] * len(commands)
        try:
            replies = node.client.pipeline(commands, self._step(deadline))
        except Exception as e:  # noqa: BLE001 - a server's failure, whatever form it takes, is a cache miss
            self._failed(node, op, e)
            return [_UNSERVED] * len(commands)
        return replies

    def _unserved(self, op: str, reply: Any) -> bool:
        """True (after counting and warning) if `reply` is not an answer about the entry."""
        if reply is _UNSERVED:
            self._count(errors=1)
            return True
        if isinstance(reply, ReplyError):
            self._count(errors=1)
            self._warn(f"{op}-refused", "kvtc.store: Redis at %s refused a %s: %s", self.address, op, printable(reply))
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
        out: dict[str, bool] = {}
        for key, blob in list(blobs.items()):
            if len(blob) > self.max_entry_bytes:  # never write what no reader of this setting would read
                out[key] = False
                del blobs[key]
                self._warn(
                    "too-large",
                    "kvtc.store: entry of %d bytes exceeds max_entry_bytes=%d; not stored",
                    len(blob),
                    self.max_entry_bytes,
                )
        replies = self._run("put", {key: ("SET", self.redis_key(key), blob, *expiry) for key, blob in blobs.items()})
        for key, blob in blobs.items():
            reply = replies[key]
            out[key] = ok = isinstance(reply, Status) and reply == b"OK"
            if ok:
                self._count(puts=1, bytes=len(blob))
            elif not self._unserved("put", reply):  # e.g. OOM: writes above maxmemory with noeviction
                self._count(errors=1)
                self._warn(
                    "put-odd",
                    "kvtc.store: Redis at %s answered a write with %s",
                    self.address,
                    printable(repr(reply), 100),
                )
        return {key: out[key] for key in items}

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        names = {key: self.redis_key(key) for key in keys}
        deadline = self._call_deadline()
        replies = self._run("get", {key: ("GET", name) for key, name in names.items()}, deadline)
        out: dict[str, bytes | None] = {}
        for key, name in names.items():
            blob = replies[key]
            out[key] = None
            if blob is None or self._unserved("get", blob):
                self._count(misses=1)
                continue
            try:
                if not isinstance(blob, bytes) or isinstance(blob, Status):
                    raise FormatError(f"the server answered GET with {type(blob).__name__}, not a string")
                out[key] = unseal(self.namespace, key, blob)
                self._count(hits=1)
            except FormatError as e:
                self._count(misses=1, corrupt=1)
                self._warn("corrupt", "kvtc.store: removed bad Redis entry %s: %s", name, printable(e))
                if isinstance(blob, bytes) and not isinstance(blob, Status):
                    self._delete_if_unchanged(name, blob, deadline)
        return out

    def _delete_if_unchanged(self, name: str, blob: bytes, deadline: float) -> None:
        # Compare-and-delete, so that a good entry written meanwhile by another client survives.
        ((node, _),) = self._route({name: ("GET", name)}, deadline)
        if node is None or time.monotonic() < node.down_until or time.monotonic() >= deadline:
            return
        step = self._step(deadline)
        try:
            with node.client.connection(step) as conn:
                _, current = conn.exchange([("WATCH", name), ("GET", name)], step)
                if current == blob and not isinstance(current, Status):
                    conn.exchange([("MULTI",), ("DEL", name), ("EXEC",)], step)  # EXEC is nil if it changed
                else:
                    conn.exchange([("UNWATCH",)], step)
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
            self._route({}, self._call_deadline())  # reads the slot map if there is none
            nodes = list({id(n): n for n in self._slots or () if n is not None}.values())
        else:
            nodes = [self._node(*self._seeds[0])]
        return sum(self._clear_node(node) for node in nodes)

    def _clear_node(self, node: _Node) -> int:
        removed = 0
        cursor = b"0"
        seen: set[bytes] = set()  # a cursor seen twice (or too many batches): a server that would loop forever
        pattern = _glob_escape(self.key_prefix) + "*"
        try:
            for _ in range(MAX_SCAN_BATCHES):  # each SCAN batch is one exchange, with its own timeout
                reply = node.client.execute(
                    "SCAN", cursor, "MATCH", pattern, "COUNT", 1000, deadline=time.monotonic() + self.timeout
                )
                if not (
                    isinstance(reply, list)
                    and len(reply) == 2
                    and isinstance(reply[1], list)
                    and isinstance(reply[0], bytes)
                    and reply[0].isdigit()
                    and reply[0] not in seen
                    and all(isinstance(n, bytes) and not isinstance(n, Status) for n in reply[1])
                ):
                    raise TypeError(f"SCAN answered {printable(repr(reply), 100)}")
                cursor, names = reply
                seen.add(cursor)
                if names:  # one DEL per key: the keys of a batch may lie in different slots
                    done = node.client.pipeline([("DEL", n) for n in names], time.monotonic() + self.timeout)
                    removed += sum(n for n in done if _is_count(n))
                if cursor == b"0":
                    return removed
            raise TypeError(f"SCAN went on for more than {MAX_SCAN_BATCHES} batches")
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
