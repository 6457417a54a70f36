"""Where compressed KV caches are kept: one `Store` interface, three backends chosen by URL.

==================================================================  ====================================
URL                                                                 store
==================================================================  ====================================
``file:///var/cache/kvtc?max_bytes=20GiB`` or a plain path          `FileStore` (the default): sharded
                                                                    files, atomic writes, LRU byte budget
``memory://?max_bytes=256MiB``                                      `MemoryStore`: in-process LRU
``redis://host:6379/0?ttl=3600&prefix=kvtc:`` (``rediss://``)       `RedisStore`: shared through Redis or
                                                                    Valkey
``redis+cluster://h1:7000,h2:7000,h3:7000?ttl=3600``                `RedisStore` routing by hash slot over
(``rediss+cluster://``)                                             a Redis / Valkey cluster
==================================================================  ====================================

``open_store(url, namespace)`` opens one; `namespace` names the model and calibration the entries
belong to (e.g. ``f"{model_id}:{calibration_hash}"``) and an entry written under one namespace is
never returned under another. Every URL part is checked there (`StoreError` names what to fix). The
entry envelope and the failure policy are documented in `kvtc.store.base`.

What a store reads is bounded, for stores shared with writers that may be hostile: ``max_entry_bytes`` (file:
4 GiB by default, checked against an entry's header before its payload is read; Redis: 512 MiB, checked
against a reply's header), file paths never followed through links (`kvtc.store.fsdir`), and every Redis call
within twice its ``timeout`` whatever the servers send or the slot map says (`kvtc.store.resp`).
"""

from __future__ import annotations

from .base import Store, entry_id, seal, unseal
from .file import FileStore
from .memory import MemoryStore
from .redis import RedisStore
from .url import open_store

__all__ = ["FileStore", "MemoryStore", "RedisStore", "Store", "entry_id", "open_store", "seal", "unseal"]
