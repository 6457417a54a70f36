"""Which tokens attention reads, estimated from what the encoder holds: the attention mass the token-adaptive rates
(:mod:`kvtc.codec.tiers`, the rate ladder of :mod:`kvtc.codec.ladder`) rank tokens by.

The estimate uses the exact cache and, from the calibration,
a map that predicts each query head's pre-RoPE query from its token's own pre-RoPE key (``Calibration.query_map``,
a ridge regression fitted on the calibration corpus; calibrations of recipe r11 have only each head's mean query,
``Calibration.queries``, which then stands in for every query). The queries of ``QUERY_POSITIONS`` of the slice's
newest ``RECENT`` positions (whose keys the codec keeps exact) are predicted from their keys and rotated to their
positions, and the softmax attention they give every token a layer holds (causal, within the layer's sliding
window) is summed over the group's layers, heads and queries (docs/studies/token-importance.md:
ranking by mean queries lowered next-token KL by 25-45% at 16-32x, a random ranking made it worse;
docs/studies/history.md, "Recipe r12": predicted queries lower it 3-4% more).
"""

from __future__ import annotations

from typing import Any

import torch

#: the newest positions whose (mean) queries score the tokens, and how many of them are used
RECENT = 128
QUERY_POSITIONS = 32


def predicted_queries(keys: torch.Tensor, query_map: torch.Tensor) -> torch.Tensor:
    """``[B, Q, L, H·G, D]`` float32: each query head's pre-RoPE query predicted from its token's pre-RoPE key
    ``keys`` ``[B, Q, L, H, D]`` by ``query_map`` ``[L, H, D + 1, G·D]`` (the last row: the intercept)."""
    B, Q, L, H, D = keys.shape
    m = query_map.to(keys.device, torch.float32)
    q = torch.einsum("bqlhd,lhde->bqlhe", keys.float(), m[:, :, :D]) + m[:, :, D]
    return q.reshape(B, Q, L, H * (m.shape[-1] // D), D)


def attention_mass(
    keys: torch.Tensor,
    positions: torch.Tensor,
    layout: Any,
    queries: torch.Tensor,
    scales: torch.Tensor,
    rope: Any,
    query_map: torch.Tensor | None = None,
    moment: int = 1,
) -> torch.Tensor:
    """``[B, L, T]`` float32: the attention each token of each layer receives from queries at the slice's newest
    positions (zero for tokens a layer does not hold): those predicted from their keys by ``query_map`` when given,
    else the mean queries; summed over query heads and positions (``moment`` 2: the squares of the attention
    probabilities summed instead).

    ``keys``: the slice's pre-RoPE keys ``[B, T, L, H, D]``; ``queries``: ``[L, H, G, D]`` mean pre-RoPE queries
    (``G`` query heads per KV head); ``scales``: ``[L]`` the attention's logit scale; ``rope``: the model's
    :class:`~kvtc.rope.RopeSpec` or None (no RoPE); ``query_map``: ``[L, H, D + 1, G·D]``
    (:func:`predicted_queries`)."""
    B, T, L, H, D = keys.shape
    dev = keys.device
    out = torch.zeros((B, L, T), dtype=torch.float32, device=dev)
    if T == 0:
        return out
    recent = min(RECENT, T)
    q_idx = torch.linspace(T - recent, T - 1, min(QUERY_POSITIONS, recent), device=dev).round().long().unique()
    Q = q_idx.numel()
    G = queries.shape[2]
    k = keys.float()
    if query_map is not None:
        q = predicted_queries(k[:, q_idx], query_map)
    else:
        q = queries.to(dev, torch.float32).reshape(1, 1, L, H * G, D).expand(B, Q, L, H * G, D)
    qpos = positions[:, q_idx]
    if rope is not None:
        k = rope.apply(k, positions, list(layout.layers))
        q = rope.apply(q.contiguous(), qpos, list(layout.layers))
    diff = qpos[:, :, None] - positions[:, None, :]  # [B, Q, T]
    for i in range(L):
        first = T - layout.held(i, T)
        kk = k[:, first:, i]  # [B, n, H, D]
        qq = q[:, :, i].reshape(B, Q, H, G, D)
        logits = torch.einsum("bqhgd,bnhd->bhgqn", qq, kk) * float(scales[i])
        d = diff[:, :, first:]
        mask = d < 0
        limit = layout.limit(i)
        if limit:
            mask |= d >= limit
        logits = logits.masked_fill(mask[:, None, None], float("-inf"))
        p = torch.nan_to_num(logits.softmax(-1))  # a query that sees no held token gives none of them mass
        out[:, i, first:] = (p if moment == 1 else p**moment).sum((1, 2, 3))
    return out


__all__ = ["QUERY_POSITIONS", "RECENT", "attention_mass", "predicted_queries"]
