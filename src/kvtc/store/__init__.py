"""Where compressed KV caches are kept: one `Store` interface, three backends chosen by URL.

=============================================================  =========================================
URL                                                            store
=============================================================  =========================================
``file:///var/cache/kvtc?max_bytes=20GiB`` or a plain path     `FileStore` (the default): sharded files,
                                                               atomic writes, LRU byte budget
``memory://?max_bytes=256MiB``                                 `MemoryStore`: in-process LRU
``redis://host:6379/0?ttl=3600&prefix=kvtc:`` (``rediss://``)  `RedisStore`: shared through Redis
=============================================================  =========================================

``open_store(url, namespace)`` opens one; `namespace` names the model and calibration the entries
belong to (e.g. ``f"{model_id}:{calibration_hash}"``) and an entry written under one namespace is
never returned under another. The entry envelope and the failure policy are documented in
`kvtc.store.base`.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import StoreError
from .base import Store, entry_id, parse_number, parse_size, reject_unknown_options, seal, unseal
from .file import FileStore
from .memory import DEFAULT_MEMORY_MAX_BYTES, MemoryStore
from .redis import RedisStore

__all__ = ["FileStore", "MemoryStore", "RedisStore", "Store", "entry_id", "open_store", "seal", "unseal"]


def open_store(url: str, namespace: str) -> Store:
    """Open the store that `url` names, for entries of `namespace` (model + calibration identity)."""
    if not isinstance(url, str) or not url:
        raise StoreError(f"store URL must be a non-empty str, got {url!r}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        options = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
    except ValueError:
        raise StoreError(f"store URL {url!r} has a malformed query string; use ?name=value&name=value") from None

    if scheme in ("", "file"):
        reject_unknown_options("file", options, ("max_bytes", "evict_to", "tmp_grace", "sweep_interval"))
        if scheme == "":
            root = url.split("?", 1)[0]
        elif parts.netloc not in ("", "localhost"):
            raise StoreError(f"file store URL {url!r} names host {parts.netloc!r}; use file:///absolute/path")
        else:
            root = unquote(parts.path)
        if not root:
            raise StoreError(f"file store URL {url!r} names no directory; use file:///absolute/path")
        kwargs: dict[str, float] = {}
        for name in ("evict_to", "tmp_grace", "sweep_interval"):
            if name in options:
                kwargs[name] = parse_number(options[name], name)
        max_bytes = parse_size(options["max_bytes"]) if "max_bytes" in options else None
        return FileStore(root, namespace, max_bytes, **kwargs)

    if scheme == "memory":
        reject_unknown_options("memory", options, ("max_bytes",))
        max_bytes = parse_size(options["max_bytes"]) if "max_bytes" in options else DEFAULT_MEMORY_MAX_BYTES
        return MemoryStore(namespace, max_bytes)

    if scheme in ("redis", "rediss"):
        reject_unknown_options("redis", options, ("ttl", "prefix", "timeout", "retry_interval"))
        db_text = parts.path.strip("/") or "0"
        try:
            port = parts.port or 6379
            db = int(db_text)
        except ValueError:
            raise StoreError(f"redis store URL {url!r}: port and database must be integers, "
                             "as in redis://host:6379/0") from None
        redis_options: dict[str, object] = {
            name: parse_number(options[name], name) for name in ("ttl", "timeout", "retry_interval") if name in options
        }
        if "prefix" in options:
            redis_options["prefix"] = options["prefix"]
        return RedisStore(
            namespace,
            host=parts.hostname or "127.0.0.1",
            port=port,
            db=db,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            ssl=scheme == "rediss",
            **redis_options,  # type: ignore[arg-type]
        )

    raise StoreError(f"unknown store URL scheme {parts.scheme!r} in {url!r}; use file://, memory:// or redis://")
