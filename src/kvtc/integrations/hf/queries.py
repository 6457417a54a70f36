"""Each attention head's mean pre-RoPE query, and a map that predicts a token's query from its own key, recorded while
a transformers model runs the calibration windows.

The encoder's token-adaptive rates (:mod:`kvtc.codec.tiers`) rank a cache's tokens by the attention that queries
give them: the mean queries, or (with the map) the queries predicted from the newest tokens' exact keys. The map is
a ridge regression per layer and KV head, ``[key, 1] @ map`` giving the pre-RoPE queries of the ``G`` query heads
that read that KV head, fitted on the same tokens as the mean. They are recorded through transformers' public
attention registry: for the duration of :func:`recording_queries` the model runs a registered attention function
(``kvtc_query_recorder``) that notes each layer's queries and keys (post-RoPE, as the attention receives them;
rotated back with the model's :class:`~kvtc.rope.RopeSpec`, as kvtc does with keys) and the logit scale, and then
computes attention with PyTorch's scaled-dot-product kernel and transformers' own causal / sliding-window masks, as ``"sdpa"`` does. The
model's own attention implementation is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ...errors import CalibrationError

#: the name the recorder is registered under in transformers' attention and mask registries
RECORDER = "kvtc_query_recorder"


#: the ridge of the key-to-query map, relative to the mean diagonal of each head's key Gram matrix
RIDGE = 1e-2


class QueryRecorder:
    """Sums of each layer's pre-RoPE queries past the first ``sinks`` positions of prefill passes (and, with
    ``keys``, the moments of a regression of those queries on the tokens' own pre-RoPE keys)."""

    def __init__(self, layout: Any, rope: Any, sinks: int, keys: bool = False):
        self.layout, self.rope, self.sinks, self.keys = layout, rope, sinks, keys
        self._index = {layer: i for i, layer in enumerate(layout.layers)}
        self.sums: list[torch.Tensor | None] = [None] * len(layout.layers)
        self.gram: list[torch.Tensor | None] = [None] * len(layout.layers)  # [H, D+1, D+1]
        self.cross: list[torch.Tensor | None] = [None] * len(layout.layers)  # [H, D+1, G*D]
        self.counts = [0] * len(layout.layers)
        self.scales = [0.0] * len(layout.layers)

    def record(self, module: Any, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        i = self._index.get(getattr(module, "layer_idx", None))
        T = query.shape[2]
        if i is None or key.shape[2] != T or T <= self.sinks:  # only whole prefills from position 0
            return
        B, Hq, _, D = query.shape
        q = query.detach().float().transpose(1, 2)[:, :, None]  # [B, T, 1, Hq, D]
        if self.rope is not None:
            pos = torch.arange(T, device=q.device)[None].expand(B, T)
            q = self.rope.invert(q, pos, [self.layout.layers[i]])
        s = q[:, self.sinks :, 0].sum((0, 1)).double().cpu()  # [Hq, D]
        self.sums[i] = s if self.sums[i] is None else self.sums[i] + s
        if self.keys:
            self._moments(i, q[:, self.sinks :, 0], key)
        self.counts[i] += B * (T - self.sinks)
        self.scales[i] = float(scaling if scaling is not None else D**-0.5)

    def _moments(self, i: int, q: torch.Tensor, key: torch.Tensor) -> None:
        """Add the regression moments of layer ``i``: ``q`` ``[B, n, Hq, D]`` pre-RoPE queries past the sinks,
        ``key`` ``[B, Hkv, T, D]`` as the attention received it."""
        B, T = key.shape[0], key.shape[2]
        k = key.detach().float().transpose(1, 2)[:, :, None]  # [B, T, 1, Hkv, D]
        if self.rope is not None:
            pos = torch.arange(T, device=k.device)[None].expand(B, T)
            k = self.rope.invert(k, pos, [self.layout.layers[i]])
        k = k[:, self.sinks :, 0].double()  # [B, n, Hkv, D]
        hkv, hq = k.shape[2], q.shape[2]
        if hq % hkv:
            raise CalibrationError(f"{hq} query heads do not divide among {hkv} KV heads")
        x = torch.cat([k, torch.ones_like(k[..., :1])], -1).transpose(1, 2).reshape(B, hkv, -1, k.shape[-1] + 1)
        x = x.transpose(0, 1).reshape(hkv, -1, k.shape[-1] + 1)  # [Hkv, B*n, D+1]
        y = q.double().reshape(B, q.shape[1], hkv, -1).transpose(1, 2).transpose(0, 1).reshape(hkv, x.shape[1], -1)
        g, c = (x.transpose(1, 2) @ x).cpu(), (x.transpose(1, 2) @ y).cpu()
        self.gram[i] = g if self.gram[i] is None else self.gram[i] + g
        self.cross[i] = c if self.cross[i] is None else self.cross[i] + c

    def query_map(self) -> torch.Tensor:
        """``[layers, kv heads, head_dim + 1, G · head_dim]`` float32: the ridge regression of each head group's
        pre-RoPE queries on its KV head's pre-RoPE key and a constant (the last row: the intercept)."""
        lay = self.layout
        if not self.keys or any(g is None for g in self.gram):
            raise CalibrationError("no key-to-query moments were recorded; calibrate with the recipe's queries='keys'")
        out = []
        for g, c in zip(self.gram, self.cross):
            assert g is not None and c is not None
            d = g.shape[-1]
            ridge = RIDGE * g[:, : d - 1, : d - 1].diagonal(dim1=1, dim2=2).mean(1)  # the constant is not shrunk
            eye = torch.eye(d, dtype=g.dtype)
            eye[-1, -1] = 0
            a = torch.linalg.solve(g + ridge[:, None, None] * eye + 1e-9 * torch.eye(d, dtype=g.dtype), c)
            out.append(a)
        m = torch.stack(out).float()  # [L, Hkv, D+1, G*D]
        return m[:, list(lay.heads)].contiguous()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([layers, kv heads, G, head_dim], [layers])`` float32: the mean queries and logit scales."""
        lay = self.layout
        missing = [lay.layers[i] for i, s in enumerate(self.sums) if s is None]
        if missing:
            raise CalibrationError(
                f"no queries were recorded for layers {missing[:6]}: the model's attention did not go through "
                "transformers' attention registry; calibrate with the recipe's queries='none'"
            )
        q = torch.stack([s / c for s, c in zip(self.sums, self.counts)]).float()  # type: ignore[operator]
        hq = q.shape[1]
        if hq % lay.num_kv_heads:
            raise CalibrationError(f"{hq} query heads do not divide among {lay.num_kv_heads} KV heads")
        q = q.view(len(lay.layers), lay.num_kv_heads, hq // lay.num_kv_heads, lay.head_dim)
        q = q[:, list(lay.heads)].contiguous()
        return q, torch.tensor(self.scales, dtype=torch.float32)


@contextmanager
def recording_queries(model: Any, layout: Any, rope: Any, sinks: int, keys: bool = False) -> Iterator[QueryRecorder]:
    """Run ``model`` with the query recorder as its attention inside the block (``keys``: also the moments of the
    key-to-query map); yields the recorder."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    recorder = QueryRecorder(layout, rope, sinks, keys)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any):
        recorder.record(module, query, key, kw.get("scaling", getattr(module, "scaling", None)))
        return sdpa(module, query, key, value, mask, **kw)

    AttentionInterface.register(RECORDER, attention)
    AttentionMaskInterface.register(RECORDER, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    before = model.config._attn_implementation
    model.set_attn_implementation(RECORDER)
    try:
        yield recorder
    finally:
        model.set_attn_implementation(before)


__all__ = ["RECORDER", "QueryRecorder", "recording_queries"]
