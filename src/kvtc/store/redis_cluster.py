"""Redis Cluster routing for `RedisStore`: hash slots and the slot map read from ``CLUSTER SLOTS``.

A cluster splits the key space into 16384 hash slots, each served by one master. A key's slot is
CRC16 (XMODEM) of the key, or of the part between the first ``{`` and the next ``}`` when that part
is not empty (a *hash tag*), modulo 16384. kvtc's keys carry no hash tag, so a namespace's entries
spread over every master.

The slot map comes from any reachable node's ``CLUSTER SLOTS`` reply (Redis >= 3, Valkey). A reply
is used only if every field is what the command documents: anything else (a server that is not a
cluster node, a hostile or garbled answer) is rejected as a whole with `TopologyError`, and the
store keeps serving what it knew before. So is a map of more than `MAX_RANGES` ranges or naming more than
`MAX_MASTERS` masters (Redis Cluster is designed for up to 1,000 nodes): the store never keeps, connects to or
waits on more servers than that because a map says so.
"""

from __future__ import annotations

import binascii
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import StoreError
from ..textsafe import printable

SLOTS = 16384
MAX_HOST_CHARS = 255
#: Slot ranges and distinct masters accepted in one slot map.
MAX_RANGES = SLOTS
MAX_MASTERS = 1000
#: Nodes asked for the slot map in one read (the others are asked by later reads, in turn).
MAP_TRIES = 3
#: Least seconds between two reads of the cluster slot map (a storm of MOVED replies costs one read).
MIN_MAP_INTERVAL_S = 0.1


class TopologyError(ValueError):
    """A ``CLUSTER SLOTS`` reply that does not describe a cluster."""


def key_slot(key: bytes) -> int:
    """The cluster hash slot of `key` (hash tags honoured)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % SLOTS  # CRC16-CCITT (XMODEM), as Redis computes it


def check_host(host: str, what: str) -> str:
    """`host` if it can name a server (no blanks, controls, slashes or ``@``, 1..255 chars)."""
    if not 1 <= len(host) <= MAX_HOST_CHARS or any(c.isspace() or ord(c) < 32 or c in "/@\\?#" for c in host):
        raise StoreError(f"{what}: {printable(repr(host), 80)} is not a host name or address")
    return host


def check_port(port: Any, what: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise StoreError(f"{what}: port {printable(repr(port), 40)} is not in 1..65535")
    return port


def parse_cluster_slots(reply: Any, asked_host: str) -> list[tuple[int, int, str, int]]:
    """``[(first slot, last slot, master host, master port)]`` from a raw ``CLUSTER SLOTS`` reply.

    An empty host or ``?`` (the node does not know its own address) means the host that was asked.
    Raises `TopologyError` for anything that is not a well-formed reply.
    """
    if not isinstance(reply, list) or not reply:
        raise TopologyError(f"CLUSTER SLOTS answered {_brief(reply)}, not a list of slot ranges")
    if len(reply) > MAX_RANGES:
        raise TopologyError(f"CLUSTER SLOTS answered {len(reply)} slot ranges; a cluster has at most {MAX_RANGES}")
    ranges = []
    masters: set[tuple[str, int]] = set()
    for item in reply:
        if not isinstance(item, list) or len(item) < 3:
            raise TopologyError(f"CLUSTER SLOTS range {_brief(item)} is not [first, last, master, ...]")
        first, last, master = item[0], item[1], item[2]
        if not (_is_int(first) and _is_int(last) and 0 <= first <= last < SLOTS):
            raise TopologyError(f"CLUSTER SLOTS range {_brief(first)}..{_brief(last)} is not within 0..{SLOTS - 1}")
        if not isinstance(master, list) or len(master) < 2 or not isinstance(master[0], (bytes, str)):
            raise TopologyError(f"CLUSTER SLOTS master {_brief(master)} is not [host, port, ...]")
        raw = master[0]
        try:
            host = raw.decode("ascii") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError:
            raise TopologyError(f"CLUSTER SLOTS host {_brief(raw)} is not ASCII") from None
        try:
            host = check_host(asked_host if host in ("", "?") else host, "CLUSTER SLOTS")
            port = check_port(master[1], "CLUSTER SLOTS")
        except StoreError as e:
            raise TopologyError(str(e)) from None
        masters.add((host, port))
        if len(masters) > MAX_MASTERS:
            raise TopologyError(f"CLUSTER SLOTS names more than {MAX_MASTERS} masters; refused")
        ranges.append((first, last, host, port))
    return ranges


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _brief(value: Any, limit: int = 60) -> str:
    return printable(repr(value) if not isinstance(value, list) else f"a list of {len(value)}", limit)


def slot_owners(ranges: Sequence[tuple[int, int, str, int]]) -> list[tuple[str, int] | None]:
    """A table of 16384 entries: the (host, port) that serves each slot, or None."""
    table: list[tuple[str, int] | None] = [None] * SLOTS
    for first, last, host, port in ranges:
        table[first : last + 1] = [(host, port)] * (last + 1 - first)
    return table


class ClusterRouting:
    """The slot routing half of `RedisStore` (a mixin; the store holds the state it reads and writes): which
    master serves each key, and the slot map read from at most `MAP_TRIES` nodes per read, each exchange within
    the store's ``timeout`` and the whole read within the calling operation's deadline. Nodes the new map no
    longer names (and that are not in the URL) are forgotten, so a map that changes on every read cannot make the
    store keep more than `MAX_MASTERS` servers."""

    # provided by RedisStore
    cluster: bool
    address: str
    retry_interval: float
    _slots: list[Any] | None
    _seeds: list[tuple[str, int]]
    _nodes: dict[tuple[str, int], Any]
    _map_version: int
    _next_map_read: float
    _last_map_read: float
    _lock: Any
    _node: Any
    _step: Any
    _count: Any
    _warn: Any

    def _route(self, commands: Mapping[str, tuple], deadline: float) -> list[tuple[Any, list[str]]]:
        """Group the keys of `commands` by the server that holds them (None: no server known for it)."""
        if not self.cluster:
            return [(self._node(*self._seeds[0]), list(commands))]
        slots = self._slots
        if slots is None or (self._next_map_read and time.monotonic() >= self._next_map_read):
            self._read_map(self._map_version, deadline)
            slots = self._slots
        groups: dict[int, tuple[Any, list[str]]] = {}
        for key, command in commands.items():
            node = slots[key_slot(command[1].encode())] if slots is not None else None
            groups.setdefault(id(node), (node, []))[1].append(key)
        return list(groups.values())

    def _read_map(self, seen_version: int, deadline: float) -> bool:
        """Read the slot map from the first of at most `MAP_TRIES` nodes that answers well, before `deadline`;
        True if it changed since `seen_version`."""
        with self._lock:
            if self._map_version != seen_version:
                return True  # another thread has just read it
            now = time.monotonic()
            recent = self._slots is not None and now - self._last_map_read < MIN_MAP_INTERVAL_S
            if recent or now < self._next_map_read:
                return False  # read moments ago, or no node answered moments ago
            self._last_map_read = now
            known = list(self._nodes)
        seeds = set(self._seeds)
        candidates = sorted(  # up first; then those whose last map read did not fail, seeds first; then the
            # others, longest failed first (so that each node gets its turn, MAP_TRIES at a time)
            ((hp, self._node(*hp)) for hp in dict.fromkeys([*self._seeds, *known])),
            key=lambda item: (item[1].down_until > now, item[1].map_failed, item[0] not in seeds),
        )
        problems = []
        for (host, _port), node in candidates[:MAP_TRIES]:
            if time.monotonic() >= deadline:
                problems.append("out of time")
                break
            node.map_failed = time.monotonic()  # until it answers well
            try:
                ranges = parse_cluster_slots(
                    node.client.execute("CLUSTER", "SLOTS", deadline=self._step(deadline)), host
                )
            except TopologyError as e:
                problems.append(f"{node.address}: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - any failure of one node: ask the next
                node.down_until = time.monotonic() + self.retry_interval
                problems.append(f"{node.address}: {type(e).__name__}")
                continue
            node.map_failed = 0.0
            masters = {(h, p): self._node(h, p) for _, _, h, p in ranges}
            slots = [None if owner is None else masters[owner] for owner in slot_owners(ranges)]
            with self._lock:
                self._slots = slots
                self._map_version += 1
                self._next_map_read = 0.0
                gone = [self._nodes.pop(hp) for hp in list(self._nodes) if hp not in masters and hp not in seeds]
            for old in gone:  # servers the map no longer names are forgotten
                old.client.close()
            return True
        with self._lock:
            self._next_map_read = time.monotonic() + max(self.retry_interval, 0.05)
        self._count(errors=1)
        self._warn(
            "cluster-map",
            "kvtc.store: no Redis Cluster node of %s gave a slot map (%s); serving misses",
            self.address,
            printable("; ".join(problems), 500),
        )
        return False

    def _redirected(self, version: int, deadline: float) -> bool:
        if not self.cluster:
            self.cluster = True  # a redis:// URL naming a cluster node: route by slot from now on
            self._warn(
                "detected-cluster",
                "kvtc.store: Redis at %s is a cluster node; routing keys by hash slot "
                "(name it redis+cluster:// to say so)",
                self.address,
            )
        return self._read_map(version, deadline)
