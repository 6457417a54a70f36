"""What the connector is configured with, checked when the engine starts.

:class:`ConnectorConfig` parses and validates ``kv_connector_extra_config``; :class:`ConnectorSetup` adds what
the engine decides (block size, tensor parallelism, model) and names the store namespace of each rank. Both
halves of the connector receive the one :class:`ConnectorSetup`. Every refusal is a
:class:`~kvtc.errors.ConfigError` naming the key, the value and the fix.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ...errors import ConfigError, StoreError
from ...store import Store, open_store
from ...textsafe import message
from . import WHERE

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Defaults of `ConnectorConfig`, named once.
DEFAULT_CODEC = "kvtc"
DEFAULT_RATIO = 16.0
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_STORE = "file://" + os.path.join(os.path.expanduser("~"), ".cache", "kvtc", "vllm")
#: Attention sinks kept uncompressed at the start of a sequence (paper: s = 4); later chunks have none.
DEFAULT_SINKS = 4
CODECS = ("kvtc", "identity")
#: The keys ``kv_connector_extra_config`` may hold.
KEYS = ("codec", "calibration", "ratio", "store", "chunk_tokens", "sinks")


def _refuse(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{WHERE}: {key}={value!r} {problem}; {fix}")


def _coerce(key: str, value: Any, kind: type, fix: str) -> Any:
    """``value`` as ``kind`` (``float`` or ``int``): a number of that kind (an int may also be a float without a
    fraction), or a string holding one (a CLI may pass ``"16"``). Booleans are refused."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if kind is float:
            return float(value)
        if isinstance(value, int) or value.is_integer():
            return int(value)
    if isinstance(value, str):
        try:
            return kind(value.strip())
        except ValueError:
            pass
    raise _refuse(key, value, "is not a number" if kind is float else "is not a whole number", fix)


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` may set (see the table in docs/VLLM.md).

    ``codec``: ``"kvtc"`` (transform coding, needs ``calibration``) or ``"identity"`` (raw keys and values
    through the same path, for debugging). ``calibration``: the calibration file for the served model.
    ``ratio``: target compression ratio of the kvtc codec; the calibration must hold a bit plan for it.
    ``store``: a :func:`kvtc.store.open_store` URL; ``file://`` or ``redis://`` (a ``memory://`` store is
    private to each process, and vLLM's scheduler and workers are separate processes).
    ``chunk_tokens``: tokens per stored entry, a multiple of the engine's block size.
    ``sinks``: leading tokens of a sequence kept uncompressed (in the first chunk).

    Values are checked (and numbers given as strings converted) on construction.
    """

    codec: str = DEFAULT_CODEC
    calibration: str | None = None
    ratio: float = DEFAULT_RATIO
    store: str = DEFAULT_STORE
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    sinks: int = DEFAULT_SINKS

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise _refuse(
                "codec",
                self.codec,
                "is not a codec",
                "set codec to 'kvtc' (needs a calibration) or 'identity' (raw KV, lossless)",
            )
        cal = self.calibration
        if cal is not None and not (isinstance(cal, (str, os.PathLike)) and str(cal)):
            raise _refuse(
                "calibration",
                cal,
                "is not a file path",
                "set calibration to the path of a file made by `kvtc calibrate`",
            )
        if self.codec == "kvtc" and cal is None:
            raise _refuse(
                "calibration",
                cal,
                "is required by codec='kvtc'",
                "set calibration to a file made by "
                "`kvtc calibrate` for the served model, or codec='identity' to store raw KV",
            )
        object.__setattr__(self, "calibration", None if cal is None else str(cal))
        ratio = _coerce("ratio", self.ratio, float, "set ratio to a compression ratio such as 16")
        if not (math.isfinite(ratio) and ratio > 1):
            raise _refuse(
                "ratio",
                self.ratio,
                "is not a compression ratio above 1",
                "set ratio to a ratio the calibration has a bit plan for, such as 16",
            )
        object.__setattr__(self, "ratio", ratio)
        chunk = _coerce(
            "chunk_tokens",
            self.chunk_tokens,
            int,
            f"set chunk_tokens to a multiple of the KV block size, such as {DEFAULT_CHUNK_TOKENS}",
        )
        if chunk <= 0:
            raise _refuse(
                "chunk_tokens",
                self.chunk_tokens,
                "is not a positive number of tokens",
                f"set chunk_tokens to a multiple of the KV block size, such as {DEFAULT_CHUNK_TOKENS}",
            )
        object.__setattr__(self, "chunk_tokens", chunk)
        sinks = _coerce("sinks", self.sinks, int, f"set sinks to a token count such as {DEFAULT_SINKS}")
        if not 0 <= sinks <= chunk:
            raise _refuse(
                "sinks",
                self.sinks,
                f"is not a token count between 0 and chunk_tokens={chunk}",
                f"set sinks to such a count (sinks sit in the first chunk), such as {DEFAULT_SINKS}",
            )
        object.__setattr__(self, "sinks", sinks)
        self._check_store_url()

    def _check_store_url(self) -> None:
        url = self.store
        if not isinstance(url, str) or not url:
            raise _refuse(
                "store", url, "is not a store URL", "set store to file:///absolute/dir or redis://host:port/db"
            )
        if urlsplit(url).scheme.lower() == "memory":
            raise _refuse(
                "store",
                url,
                "is private to one process, and vLLM's scheduler and workers run in "
                "separate processes (nothing stored would ever be found)",
                "use file:///absolute/dir or redis://host:port/db",
            )

    @classmethod
    def from_extra(cls, extra: Any) -> ConnectorConfig:
        """The configuration in ``kv_connector_extra_config`` (a dict; missing keys take their defaults)."""
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(
                f"{WHERE} must be a JSON object (a dict), got {type(extra).__name__} {extra!r}; "
                f'pass e.g. {{"calibration": "model.kvtc-calib", "ratio": 16}}'
            )
        unknown = []
        for key in extra:
            if key not in KEYS:
                close = difflib.get_close_matches(str(key), KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                unknown.append(f"{key!r}={extra[key]!r}{hint}")
        if unknown:
            raise ConfigError(
                f"{WHERE}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                f"remove {'them' if len(unknown) > 1 else 'it'} or use one of {', '.join(KEYS)}"
            )
        return cls(**extra)

    def tag(self, calibration_hash: str) -> str:
        """The codec setting in the store namespace (entries of another setting are never read)."""
        if self.codec == "identity":
            return "identity"
        return f"kvtc-{calibration_hash[:16]}-r{self.ratio:g}-s{self.sinks}"


def open_connector_store(config: ConnectorConfig, namespace: str) -> Store:
    """Open the configured store for ``namespace``; a URL that names no usable store is a :class:`ConfigError`."""
    try:
        return open_store(config.store, namespace)
    except StoreError as e:
        raise ConfigError(f"{WHERE}: store={config.store!r} cannot be opened: {message(e)}") from e


@dataclass(frozen=True)
class ConnectorSetup:
    """What both halves of the connector share: the configuration and the engine's facts.

    ``model``: the model as vLLM names it (path or hub id); ``model_dtype``: vLLM's model dtype as text;
    ``calibration_hash``: the calibration's content hash (``"none"`` for the identity codec). ``block_size``:
    tokens per block (with several KV-cache groups, the least common multiple of theirs: a chunk is a whole number
    of blocks in every group); ``groups``: vLLM's KV-cache groups (:class:`~.groups.CacheGroup`; empty: one group
    of every layer); ``hash_block_size``: tokens per prefix-cache hash (0: ``block_size``).
    """

    config: ConnectorConfig
    model: str
    model_dtype: str
    block_size: int
    tp_size: int
    total_kv_heads: int
    head_dim: int
    hash_algo: str = "sha256"
    calibration_hash: str = "none"
    groups: tuple = ()
    hash_block_size: int = 0

    def __post_init__(self) -> None:
        chunk, bs = self.config.chunk_tokens, self.block_size
        if bs <= 0 or chunk % bs:
            fix = max(bs, round(chunk / bs) * bs) if bs > 0 else DEFAULT_CHUNK_TOKENS
            raise _refuse(
                "chunk_tokens",
                chunk,
                f"is not a multiple of the engine's KV block size {bs}",
                f"set chunk_tokens to a multiple of {bs}, such as {fix}",
            )

    @classmethod
    def from_vllm(
        cls, config: ConnectorConfig, vllm_config: VllmConfig, calibration_hash: str, kv_cache_config: Any = None
    ) -> ConnectorSetup:
        from .groups import cache_groups, check_chunk, lcm_block

        parallel = vllm_config.parallel_config
        if int(parallel.pipeline_parallel_size) != 1:
            raise ConfigError(
                f"pipeline_parallel_size={parallel.pipeline_parallel_size}: the KVTC connector does "
                "not support pipeline parallelism yet; set pipeline_parallel_size to 1"
            )
        model, cache = vllm_config.model_config, vllm_config.cache_config
        groups = cache_groups(kv_cache_config, int(cache.block_size), f"the served model {str(model.model)!r}")
        block = lcm_block(groups)
        hash_block = int(getattr(kv_cache_config, "hash_block_size", None) or block)
        setup = cls(
            config=config,
            model=str(model.model),
            model_dtype=str(model.dtype),
            block_size=math.lcm(block, hash_block),
            tp_size=int(parallel.tensor_parallel_size),
            total_kv_heads=int(model.get_total_num_kv_heads()),
            head_dim=int(model.get_head_size()),
            hash_algo=str(getattr(cache, "prefix_caching_hash_algo", "sha256")),
            calibration_hash=calibration_hash,
            groups=groups,
            hash_block_size=hash_block,
        )
        check_chunk(setup.chunk, setup.block_size, tuple(g.held for g in groups))
        return setup

    @property
    def chunk(self) -> int:
        """Tokens per stored entry."""
        return self.config.chunk_tokens

    @property
    def model_id(self) -> str:
        """Short model name recorded in blobs and namespaces."""
        return os.path.basename(self.model.rstrip("/")) or "model"

    def namespace(self, rank: int) -> str:
        """Store namespace of tensor-parallel rank ``rank``: model, dtype, codec setting, vLLM's prefix hash
        algorithm, chunk size and rank. (Unchanged since the first release: entries stored before are found.)"""
        ident = f"{self.model}|{self.model_dtype}|{self.config.tag(self.calibration_hash)}|{self.hash_algo}"
        digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        return f"vllm:{self.model_id}:{digest}:c{self.chunk}:tp{rank}of{self.tp_size}"

    def heads(self, rank: int) -> tuple[int, ...]:
        """The KV heads that tensor-parallel rank ``rank`` holds."""
        total, tp = self.total_kv_heads, self.tp_size
        if total >= tp:
            per = total // tp
            return tuple(range(rank * per, (rank + 1) * per))
        return (rank * total // tp,)  # heads replicated across ranks
