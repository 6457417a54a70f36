"""`open_store`: a store from its URL, every part of which is checked before anything is opened.

Whatever the URL, `open_store` returns a store or raises `StoreError` naming the part to fix; it
never connects to a server (Redis stores connect on first use, and a server that is down then is a
cache miss, not an error).
"""

from __future__ import annotations

import math
from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import StoreError
from .base import Store, parse_size, reject_unknown_options
from .file import FileStore
from .memory import DEFAULT_MEMORY_MAX_BYTES, MemoryStore
from .redis import RedisStore
from .redis_cluster import check_host

REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
REDIS_OPTIONS = ("ttl", "prefix", "timeout", "retry_interval", "max_entry_bytes")
FILE_OPTIONS = ("max_bytes", "evict_to", "tmp_grace", "sweep_interval", "max_entry_bytes")
#: Largest byte budget accepted (2**63 - 1: what the file store's usage record can count).
MAX_BUDGET = 2**63 - 1
#: Largest number of seconds accepted by the file store's time options.
MAX_SECONDS = 10 * 365 * 86400.0
DEFAULT_REDIS_PORT = 6379


def parse_number(text: str, what: str, high: float = MAX_SECONDS) -> float:
    """A finite number in [0, high] from a URL option (seconds, fractions)."""
    try:
        value = float(text)
    except ValueError:
        raise StoreError(f"invalid {what}={text!r}: use a number") from None
    if not (math.isfinite(value) and 0 <= value <= high):
        raise StoreError(f"invalid {what}={text!r}: must be a finite number in [0, {high:g}]")
    return value


def _budget(text: str, what: str = "max_bytes") -> int:
    value = parse_size(text, what)
    if value > MAX_BUDGET:
        raise StoreError(f"invalid {what}={text!r}: at most {MAX_BUDGET} bytes")
    return value


def _entry_limit(options: dict[str, str]) -> dict[str, int]:
    """``max_entry_bytes`` as a keyword argument, when the URL gives it."""
    return (
        {"max_entry_bytes": _budget(options["max_entry_bytes"], "max_entry_bytes")}
        if "max_entry_bytes" in options
        else {}
    )


def open_store(url: str, namespace: str) -> Store:
    """Open the store that `url` names, for entries of `namespace` (model + calibration identity)."""
    if not isinstance(url, str) or not url:
        raise StoreError(f"store URL must be a non-empty str, got {url!r}")
    if "\x00" in url:
        raise StoreError("store URL contains a NUL character")
    try:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as e:
        raise StoreError(
            f"store URL {url!r} is malformed ({e}); use scheme://host/path?name=value&name=value"
        ) from None
    options = dict(pairs)
    if len(options) != len(pairs):
        raise StoreError(f"store URL {url!r} gives an option twice")
    if parts.fragment and scheme:
        raise StoreError(f"store URL {url!r} has a #fragment; stores take none")

    if scheme in ("", "file"):
        return _file_store(url, parts, scheme, options, namespace)
    if scheme == "memory":
        reject_unknown_options("memory", options, ("max_bytes",))
        if parts.netloc or parts.path not in ("", "/"):
            raise StoreError(f"memory store URL {url!r} names a place; use memory://?max_bytes=256MiB")
        return MemoryStore(
            namespace, _budget(options["max_bytes"]) if "max_bytes" in options else DEFAULT_MEMORY_MAX_BYTES
        )
    if scheme in REDIS_SCHEMES:
        return _redis_store(url, parts, scheme, options, namespace)
    raise StoreError(
        f"unknown store URL scheme {parts.scheme!r} in {url!r}; use file://, memory://, redis:// or redis+cluster://"
    )


def _file_store(url: str, parts, scheme: str, options: dict[str, str], namespace: str) -> FileStore:
    reject_unknown_options("file", options, FILE_OPTIONS)
    if scheme == "":
        root = url.split("?", 1)[0]
    elif parts.netloc not in ("", "localhost"):
        raise StoreError(f"file store URL {url!r} names host {parts.netloc!r}; use file:///absolute/path")
    else:
        root = unquote(parts.path)
    if not root or "\x00" in root:
        raise StoreError(f"file store URL {url!r} names no usable directory; use file:///absolute/path")
    kwargs: dict[str, float] = {
        name: parse_number(options[name], name)
        for name in ("evict_to", "tmp_grace", "sweep_interval")
        if name in options
    }
    max_bytes = _budget(options["max_bytes"]) if "max_bytes" in options else None
    return FileStore(root, namespace, max_bytes, **kwargs, **_entry_limit(options))


def _redis_store(url: str, parts, scheme: str, options: dict[str, str], namespace: str) -> RedisStore:
    reject_unknown_options(scheme, options, REDIS_OPTIONS)
    cluster = scheme.endswith("+cluster")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    hosts = [_host_port(url, item) for item in (hostlist.split(",") if hostlist else ["127.0.0.1"])]
    if len(hosts) > 1 and not cluster:
        raise StoreError(
            f"redis store URL {url!r} names {len(hosts)} servers; a cluster is redis+cluster://host:port,host:port,..."
        )
    db_text = parts.path.strip("/") or "0"
    if not (db_text.isascii() and db_text.isdigit()) or len(db_text) > 10:
        raise StoreError(f"redis store URL {url!r}: the database must be an integer, as in redis://host:6379/0")
    numbers = {
        name: parse_number(options[name], name, high=math.inf)
        for name in ("ttl", "timeout", "retry_interval")
        if name in options
    }
    return RedisStore(
        namespace,
        host=hosts[0][0],
        port=hosts[0][1],
        db=int(db_text),
        username=unquote(username) if username else None,
        password=unquote(password) if password else None,
        ssl=scheme.startswith("rediss"),
        cluster=cluster,
        nodes=hosts[1:],
        **({"prefix": options["prefix"]} if "prefix" in options else {}),
        **_entry_limit(options),
        **numbers,  # type: ignore[arg-type]
    )


def _host_port(url: str, item: str) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6 address]:port`` -> (host, port)."""
    if item.startswith("["):
        host, sep, rest = item[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise StoreError(f"redis store URL {url!r}: {item!r} is not [address]:port")
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
        if ":" in host:
            raise StoreError(f"redis store URL {url!r}: write an IPv6 address in brackets, as in [::1]:6379")
    if port_text == "":
        port = DEFAULT_REDIS_PORT
    elif port_text.isascii() and port_text.isdigit() and len(port_text) <= 5 and 1 <= int(port_text) <= 65535:
        port = int(port_text)
    else:
        raise StoreError(f"redis store URL {url!r}: port {port_text!r} must be an integer in 1..65535")
    return check_host(unquote(host) if host else "", f"redis store URL {url!r}"), port
