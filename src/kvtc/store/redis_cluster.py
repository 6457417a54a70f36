"""Redis Cluster routing for `RedisStore`: hash slots and the slot map read from ``CLUSTER SLOTS``.

A cluster splits the key space into 16384 hash slots, each served by one master. A key's slot is
CRC16 (XMODEM) of the key, or of the part between the first ``{`` and the next ``}`` when that part
is not empty (a *hash tag*), modulo 16384. kvtc's keys carry no hash tag, so a namespace's entries
spread over every master.

The slot map comes from any reachable node's ``CLUSTER SLOTS`` reply (Redis >= 3, Valkey). A reply
is used only if every field is what the command documents: anything else (a server that is not a
cluster node, a hostile or garbled answer) is rejected as a whole with `TopologyError`, and the
store keeps serving what it knew before.
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence
from typing import Any

from ..errors import StoreError

SLOTS = 16384
MAX_HOST_CHARS = 255


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
        raise StoreError(f"{what}: {host!r} is not a host name or address")
    return host


def check_port(port: Any, what: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise StoreError(f"{what}: port {port!r} is not in 1..65535")
    return port


def parse_cluster_slots(reply: Any, asked_host: str) -> list[tuple[int, int, str, int]]:
    """``[(first slot, last slot, master host, master port)]`` from a raw ``CLUSTER SLOTS`` reply.

    An empty host or ``?`` (the node does not know its own address) means the host that was asked.
    Raises `TopologyError` for anything that is not a well-formed reply.
    """
    if not isinstance(reply, list) or not reply:
        raise TopologyError(f"CLUSTER SLOTS answered {_brief(reply)}, not a list of slot ranges")
    ranges = []
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
        ranges.append((first, last, host, port))
    return ranges


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _brief(value: Any, limit: int = 60) -> str:
    text = repr(value) if not isinstance(value, list) else f"a list of {len(value)}"
    return text if len(text) <= limit else text[:limit] + "..."


def slot_owners(ranges: Sequence[tuple[int, int, str, int]]) -> list[tuple[str, int] | None]:
    """A table of 16384 entries: the (host, port) that serves each slot, or None."""
    table: list[tuple[str, int] | None] = [None] * SLOTS
    for first, last, host, port in ranges:
        table[first : last + 1] = [(host, port)] * (last + 1 - first)
    return table
