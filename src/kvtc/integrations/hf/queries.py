"""Each attention head's mean pre-RoPE query, recorded while a transformers model runs the calibration windows.

The encoder's token-adaptive rates (:mod:`kvtc.codec.tiers`) rank a cache's tokens by the attention these mean
queries give them. They are recorded through transformers' public attention registry: for the duration of
:func:`recording_queries` the model runs a registered attention function (``kvtc_query_recorder``) that notes each
layer's queries (post-RoPE, as the attention receives them; rotated back with the model's
:class:`~kvtc.rope.RopeSpec`, as kvtc does with keys) and the logit scale, and then computes attention with
PyTorch's scaled-dot-product kernel and transformers' own causal / sliding-window masks, as ``"sdpa"`` does. The
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


class QueryRecorder:
    """Sums of each layer's pre-RoPE queries past the first ``sinks`` positions of prefill passes."""

    def __init__(self, layout: Any, rope: Any, sinks: int):
        self.layout, self.rope, self.sinks = layout, rope, sinks
        self._index = {layer: i for i, layer in enumerate(layout.layers)}
        self.sums: list[torch.Tensor | None] = [None] * len(layout.layers)
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
        self.counts[i] += B * (T - self.sinks)
        self.scales[i] = float(scaling if scaling is not None else D**-0.5)

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
def recording_queries(model: Any, layout: Any, rope: Any, sinks: int) -> Iterator[QueryRecorder]:
    """Run ``model`` with the query recorder as its attention inside the block; yields the recorder."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    recorder = QueryRecorder(layout, rope, sinks)
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
