"""vLLM's KV-cache groups as the connector sees them: which layers share a block table, and what each keeps.

With the hybrid KV-cache manager (vLLM's default for models that mix attention types, e.g. Gemma 3's
sliding-window and global layers) every group has its own block table: a request's block ids come as one list per
group, and a sliding-window group keeps only the blocks that the window can still reach (the others are vLLM's
null block, id 0). The connector stores all layers of a chunk in one entry and restores each layer into its own
group's blocks; for a sliding-window group it writes only the blocks vLLM gave the request (the window's).

A sliding-window layer of window ``W`` attends to the ``W - 1`` tokens before the current one (vLLM and
transformers agree), so it holds ``W - 1`` tokens: ``KVLayout.max_tokens`` of the layer, as in a calibration.
An entry's chunk must not be longer than that (see :func:`check_chunk`): every token of a chunk is then one a
sliding layer holds, so the blocks the connector writes are whole, and a block vLLM later reuses from its own
prefix cache for a shorter hit never holds a token the entry lacked.

Only attention caches are served (full and sliding-window attention); latent (MLA) caches and recurrent-state
groups (Mamba and other state-space layers) are refused at startup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from . import WHERE
from .paged import NULL_BLOCK


@dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group: ``layer_names`` share a block table of ``block_size``-token blocks; ``window`` is the
    sliding window of its layers (0: full attention, every block kept)."""

    block_size: int
    layer_names: tuple[str, ...] = ()
    window: int = 0

    @property
    def held(self) -> int:
        """Tokens a layer of this group holds before the current one (0: all)."""
        return self.window - 1 if self.window else 0


def cache_groups(kv_cache_config: Any, block_size: int, model: str = "the served model") -> tuple[CacheGroup, ...]:
    """The groups of vLLM's ``KVCacheConfig`` (``None``: one full-attention group of ``block_size``-token blocks,
    holding every layer). Groups of a kind the connector cannot read are a :class:`ConfigError`."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return (CacheGroup(block_size),)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    groups = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if isinstance(spec, MLAAttentionSpec) or "MLA" in kind:
            raise mla_refused(model)
        if type(spec) is SlidingWindowSpec:
            window = int(spec.sliding_window)
        elif type(spec) is FullAttentionSpec:
            window = 0  # with the hybrid manager off, sliding layers sit here too (their window: the layer's own)
        else:
            raise ConfigError(
                f"{model} has a KV-cache group of kind {kind} (group {i}, layers {list(group.layer_names)[:3]}...): "
                "the KVTC connector stores full-attention and sliding-window attention caches only (no recurrent "
                "state, chunked-local or cross-attention caches); serve this model without kv_transfer_config"
            )
        groups.append(CacheGroup(int(spec.block_size), tuple(group.layer_names), window))
    return tuple(groups)


def mla_refused(model: str) -> ConfigError:
    return ConfigError(
        f"{model} uses multi-head latent attention (MLA, DeepSeek-style latent KV cache): the KVTC connector "
        "compresses per-head keys and values and cannot store a latent cache; serve this model without "
        "kv_transfer_config (or with a connector that supports MLA)"
    )


def lcm_block(groups: tuple[CacheGroup, ...]) -> int:
    """The smallest token count that is a whole number of blocks in every group."""
    out = 1
    for g in groups:
        out = math.lcm(out, g.block_size)
    return out


def check_chunk(chunk: int, block: int, held: tuple[int, ...]) -> None:
    """Refuse ``chunk_tokens`` longer than what a sliding-window layer holds (``held``: per layer, 0 = all).

    A longer chunk would keep only the layer's newest tokens of the chunk, and vLLM caches whole blocks: the oldest
    block of a restored window would be part missing (see the module docstring)."""
    limited = [h for h in held if h]
    if not limited:
        return
    most = min(limited)
    if chunk <= most:
        return
    fit = most // block * block
    fix = (
        f"set chunk_tokens to a multiple of {block} no larger than {most}, such as {fit}"
        if fit
        else f"start vLLM with --block-size {1 << (most.bit_length() - 1)} (or smaller) and set chunk_tokens to a "
        f"multiple of it no larger than {most}"
    )
    raise ConfigError(
        f"{WHERE}: chunk_tokens={chunk} is longer than the {most} tokens a sliding-window layer of the served "
        f"model holds (its window minus one), so a stored chunk could not restore whole blocks; {fix}"
    )


__all__ = ["NULL_BLOCK", "CacheGroup", "cache_groups", "check_chunk", "lcm_block", "mla_refused"]
