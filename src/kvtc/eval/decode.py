"""Greedy decoding on top of a (possibly restored or lossy) Hugging Face cache, timed.

One implementation for every place that continues a cache: the retrieval protocol of ``kvtc eval`` (answers
through an evicting method's attention mask), ``kvtc demo`` (the exact and each restored cache's text, and the
time to the first new token) and ``kvtc generate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Greedy:
    """What :func:`greedy_decode` produced."""

    #: int64 ``[batch, n]`` new token ids (``n <= steps``; fewer when it stopped at an end-of-sequence token)
    tokens: torch.Tensor
    #: seconds from the first forward pass to the first new token (the time to first token on a warm cache)
    first_s: float
    #: seconds for all of it
    total_s: float


def attention_mask(keep: torch.Tensor | None, extra: int) -> torch.Tensor | None:
    """``keep`` (bool ``[batch, cached]``: the cached tokens attention may see) followed by ``extra`` visible
    tokens, as the int64 mask a model takes; ``None`` (attend to everything) for ``keep=None``."""
    if keep is None:
        return None
    return torch.cat([keep.long(), torch.ones(keep.shape[0], extra, dtype=torch.long, device=keep.device)], dim=1)


def greedy_decode(
    model: Any,
    ids: torch.Tensor,
    cache: Any = None,
    steps: int = 32,
    *,
    keep: torch.Tensor | None = None,
    stop_at_eos: bool = False,
) -> Greedy:
    """Feed ``ids`` (int64 ``[batch, n]``, the tokens not yet in ``cache``) and decode ``steps`` tokens greedily.

    ``cache``: a ``DynamicCache`` holding the tokens before ``ids`` (``None``: start from nothing, i.e. a full
    prefill of ``ids``); it is extended in place. ``keep``: attention mask of the cached tokens (for methods
    that evict some). ``stop_at_eos``: a single sequence stops after the model's end-of-sequence token.
    """
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"greedy_decode needs token ids of shape [batch, n >= 1], got {tuple(ids.shape)}")
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    eos: set[int] = set()
    if stop_at_eos and ids.shape[0] == 1:
        got = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = set(got if isinstance(got, list) else [got]) if got is not None else set()
    out: list[torch.Tensor] = []
    step, fed = ids, 0
    t0 = time.perf_counter()
    t_first = 0.0
    with torch.inference_mode():
        for i in range(steps):
            fed += step.shape[1]
            logits = model(
                input_ids=step, past_key_values=cache, attention_mask=attention_mask(keep, fed), use_cache=True
            ).logits[:, -1]
            step = logits.argmax(-1, keepdim=True)
            out.append(step)
            if i == 0:
                if step.is_cuda:
                    torch.cuda.synchronize(step.device)
                t_first = time.perf_counter() - t0
            if eos and int(step) in eos:
                break
    tokens = torch.cat(out, dim=1) if out else ids.new_zeros(ids.shape[0], 0)
    return Greedy(tokens, t_first, time.perf_counter() - t0)
