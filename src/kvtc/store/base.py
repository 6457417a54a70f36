"""The `Store` interface, the entry envelope every persistent store writes, and shared helpers.

A store keeps opaque byte strings (kvtc containers, but nothing here depends on the codec) under
string keys, inside one *namespace*: the identity of the model and calibration the bytes belong to,
e.g. ``f"{model_id}:{calibration_hash}"``. A store opened under one namespace never returns an entry
written under another: the storage location is derived from a hash of (namespace, key) and the
envelope records both, checked on every read.

Envelope (version 1), all integers little-endian::

    offset  size  field
    0       4     magic  b"KVTS"
    4       1     version = 1
    5       1     flags = 0 (reserved; readers refuse anything else)
    6       2     N: namespace length in bytes (UTF-8), 1 <= N <= 65535
    8       2     K: key length in bytes (UTF-8), 1 <= K <= 65535
    10      2     reserved = 0
    12      8     P: payload length in bytes
    20      16    digest: blake2b, 16-byte output, person=b"kvtc-store-v1", over
                  bytes 0..20 of this header || namespace || key || payload
    36      N     namespace (UTF-8)
    36+N    K     key (UTF-8)
    36+N+K  P     payload

An entry is valid only if its total length is exactly 36 + N + K + P, every field above matches and
the namespace and key equal the ones asked for. Anything else (torn, truncated, bit-flipped, written
under another namespace or key, another version) is a *corrupt* entry: the read is a miss, the entry
is removed where the store can do so safely, and ``stats()["corrupt"]`` counts it.

Failure policy, the same for every store: a backend that cannot serve a request (disk full,
permission denied, a Redis server unreachable or answering nonsense, something other than a regular
file at an entry's path) logs a rate-limited warning on the ``kvtc.store`` logger,
counts ``stats()["errors"]`` and answers as a cache would: ``get`` -> ``None`` (miss), ``put`` ->
``False``, ``delete``/``contains`` -> ``False``. It never damages entries already stored and never
raises for these. `StoreError` is raised only for what the caller must fix: an invalid URL or
option, or a store root that cannot be created. Arguments of the wrong type raise `TypeError`,
over-long namespaces or keys `ValueError`.
"""

from __future__ import annotations

import hashlib
import logging
import re
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import FormatError, StoreError
from ..textsafe import printable

logger = logging.getLogger("kvtc.store")

MAGIC = b"KVTS"
ENVELOPE_VERSION = 1
_HEADER = struct.Struct("<4sBBHHHQ")  # magic, version, flags, N, K, reserved, P
DIGEST_SIZE = 16
_DIGEST_PERSON = b"kvtc-store-v1"
HEADER_SIZE = _HEADER.size + DIGEST_SIZE  # 36
MAX_NAME_BYTES = 0xFFFF

#: Seconds between two warnings of the same kind from one store handle.
WARN_INTERVAL_S = 30.0
#: Kinds of warning remembered at once (older ones are forgotten first once their interval has passed).
MAX_WARNING_KINDS = 4096

STAT_KEYS = ("hits", "misses", "puts", "bytes", "corrupt", "evictions", "errors")


def _name_bytes(what: str, value: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"store {what} must be a str, got {type(value).__name__}")
    raw = value.encode("utf-8")
    if not 1 <= len(raw) <= MAX_NAME_BYTES:
        raise ValueError(f"store {what} must be 1..{MAX_NAME_BYTES} UTF-8 bytes, got {len(raw)}")
    return raw


def _payload_bytes(value: Any) -> bytes | memoryview:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value
    raise TypeError(f"store values must be bytes-like (a kvtc container), got {type(value).__name__}")


def _digest(head: bytes, ns: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_DIGEST_PERSON)
    h.update(head)
    h.update(ns)
    h.update(key)
    h.update(payload)
    return h.digest()


def entry_id(namespace: str, key: str) -> str:
    """32 hex digits naming the entry for (namespace, key): a file name or a Redis key suffix."""
    ns, k = _name_bytes("namespace", namespace), _name_bytes("key", key)
    h = hashlib.blake2b(digest_size=16, person=b"kvtc-store-id")
    h.update(struct.pack("<H", len(ns)))
    h.update(ns)
    h.update(k)
    return h.hexdigest()


def namespace_tag(namespace: str) -> str:
    """16 hex digits naming a namespace (a Redis key prefix segment)."""
    return hashlib.blake2b(_name_bytes("namespace", namespace), digest_size=8, person=b"kvtc-store-ns").hexdigest()


def seal(namespace: str, key: str, payload: bytes | bytearray | memoryview) -> bytes:
    """Frame `payload` in an envelope that binds it to (namespace, key)."""
    ns, k, body = _name_bytes("namespace", namespace), _name_bytes("key", key), _payload_bytes(payload)
    head = _HEADER.pack(MAGIC, ENVELOPE_VERSION, 0, len(ns), len(k), 0, len(body))
    return b"".join((head, _digest(head, ns, k, body), ns, k, body))


def parse_header(head: bytes) -> int:
    """Validate the first `HEADER_SIZE` bytes of an envelope; return its total length in bytes."""
    if len(head) < HEADER_SIZE:
        raise FormatError(f"store entry truncated: {len(head)} bytes, the header alone is {HEADER_SIZE}")
    magic, version, flags, n, k, reserved, p = _HEADER.unpack_from(head)
    if magic != MAGIC:
        raise FormatError(f"store entry has magic {printable(repr(magic))}, expected {MAGIC!r}: not a kvtc store entry")
    if version != ENVELOPE_VERSION or flags != 0 or reserved != 0:
        raise FormatError(f"store entry version {version} flags {flags}: this kvtc reads version {ENVELOPE_VERSION}")
    if n == 0 or k == 0:
        raise FormatError("store entry has an empty namespace or key")
    return HEADER_SIZE + n + k + p


def _names(view: memoryview) -> tuple[bytes, bytes]:
    """The namespace and key bytes an envelope declares, after checking its header and length."""
    total = parse_header(bytes(view[:HEADER_SIZE]))
    if len(view) != total:
        raise FormatError(f"store entry is {len(view)} bytes, its header says {total}: torn or truncated")
    _, _, _, n, kl, _, _ = _HEADER.unpack_from(view)
    return bytes(view[HEADER_SIZE : HEADER_SIZE + n]), bytes(view[HEADER_SIZE + n : HEADER_SIZE + n + kl])


def envelope_names(blob: bytes | bytearray | memoryview) -> tuple[str, str]:
    """The (namespace, key) an envelope says it was written for, read without checking its checksum (for
    tools that walk a store's files; :func:`unseal` with them checks the rest). Raises `FormatError` when the
    envelope is torn or its names are not UTF-8."""
    ns, key = _names(memoryview(blob))
    try:
        return ns.decode("utf-8"), key.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"store entry names are not UTF-8 ({printable(e)}): corrupt") from e


def unseal(namespace: str, key: str, blob: bytes | bytearray | memoryview) -> bytes:
    """Return the payload of an envelope written for exactly (namespace, key).

    Raises `FormatError` when the blob is torn, corrupt, of another version, or belongs to another
    namespace or key.
    """
    ns, k = _name_bytes("namespace", namespace), _name_bytes("key", key)
    view = memoryview(blob)
    got_ns, got_key = _names(view)
    payload = view[HEADER_SIZE + len(got_ns) + len(got_key) :]
    if _digest(bytes(view[: _HEADER.size]), got_ns, got_key, payload) != bytes(view[_HEADER.size : HEADER_SIZE]):
        raise FormatError("store entry checksum mismatch: corrupt")
    if got_ns != ns or got_key != k:
        raise FormatError(
            f"store entry belongs to namespace {printable(repr(got_ns.decode('utf-8', 'replace')))} key "
            f"{printable(repr(got_key.decode('utf-8', 'replace')))}, not {namespace!r} {key!r}: foreign entry"
        )
    return bytes(payload)


_SIZE_RE = re.compile(r"^\s*([0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _SIZE_UNITS.update({_p: 1000**_i, _p + "b": 1000**_i, _p + "i": 1024**_i, _p + "ib": 1024**_i})


def parse_size(text: str, what: str = "max_bytes") -> int:
    """Parse a byte count such as ``1048576``, ``64MiB``, ``2G`` (SI: k/M/G/T; binary: Ki/Mi/Gi/Ti)."""
    m = _SIZE_RE.match(text) if len(text) <= 64 else None
    factor = _SIZE_UNITS.get(m.group(2).lower()) if m else None
    if m is None or factor is None or int(m.group(1)) == 0:
        raise StoreError(f"invalid {what}={text!r}: use a positive byte count such as 1048576, 64MiB or 2G")
    return int(m.group(1)) * factor


def reject_unknown_options(scheme: str, options: Mapping[str, str], known: Iterable[str]) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise StoreError(f"unknown {scheme}:// store option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


class Store(ABC):
    """A bounded key -> bytes cache for one namespace (model + calibration identity).

    Every method is safe to call from several threads; file and Redis stores are also safe across
    processes. `stats()` counts this handle's operations (the file store's ``bytes`` is the whole
    store's, shared by every process). Use as a context manager to `close()`.
    """

    def __init__(self, namespace: str) -> None:
        _name_bytes("namespace", namespace)
        self.namespace = namespace
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        self._last_warning: dict[str, float] = {}

    @abstractmethod
    def put(self, key: str, value: bytes) -> bool:
        """Store `value` under `key` (replacing any entry); True if it was stored."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The bytes stored under `key`, or None (absent, evicted, corrupt or backend unavailable)."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether an entry exists under `key` (cheap; `get` may still miss if it is corrupt)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove the entry under `key`; True if one was removed."""

    def close(self) -> None:  # noqa: B027 - optional: stores without connections have nothing to close
        """Release connections and file handles; the stored entries stay."""

    def put_many(self, items: Mapping[str, bytes]) -> dict[str, bool]:
        """Store several entries; returns key -> stored. Backends override this with a batched form."""
        return {key: self.put(key, value) for key, value in items.items()}

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        """Fetch several entries; returns key -> bytes or None. Backends override this with a batched form."""
        return {key: self.get(key) for key in keys}

    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, puts, bytes (held), corrupt, evictions, errors."""
        with self._stats_lock:
            return dict(self._stats)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._stats[name] += delta

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """Log a warning, at most once per `WARN_INTERVAL_S` for each kind of trouble."""
        now = time.monotonic()
        with self._stats_lock:
            last = self._last_warning.get(kind)
            if last is not None and now - last < WARN_INTERVAL_S:
                return
            if len(self._last_warning) >= MAX_WARNING_KINDS:  # kinds may name servers a slot map invents
                self._last_warning = {k: t for k, t in self._last_warning.items() if now - t < WARN_INTERVAL_S}
            self._last_warning[kind] = now
        logger.warning(message, *args)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(namespace={self.namespace!r})"
