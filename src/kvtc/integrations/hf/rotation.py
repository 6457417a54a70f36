"""Check that a loaded model rotates its keys as kvtc reads from its config (:func:`check_rotation`).

kvtc stores keys before RoPE: it undoes the rotation its :class:`~kvtc.rope.RopeSpec` (read from the config by
:mod:`.rope_probe`) describes. A model whose attention code rotates some layers otherwise than any config field
says (no RoPE in some layers, another frequency) would have its keys stored wrongly rotated: still lossless, but
compressed poorly and calibrated on the wrong basis. This module runs the model once to make sure that cannot
happen silently.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Protocol

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ...errors import UnsupportedModel
from ...layout import KVLayout
from ...rope import RopeSpec
from .rope_probe import text_config

#: the position :func:`check_rotation` runs its one token at (below any dynamic / long-context scaling threshold)
ROTATION_CHECK_POSITION = 37
#: largest relative key error :func:`check_rotation` accepts (bf16 rounding; a wrong rotation errs by ~0.3 or more)
ROTATION_CHECK_TOLERANCE = 0.05
_ROTATION_CHECKED: weakref.WeakSet[PreTrainedModel] = weakref.WeakSet()
_ROTATION_CHECKING: weakref.WeakSet[PreTrainedModel] = weakref.WeakSet()


class LayoutAndRope(Protocol):
    """What :func:`check_rotation` reads of a :class:`~kvtc.integrations.hf.adapter.ModelAdapter` (which imports
    this module): the model's KV layout and RoPE spec."""

    layout: KVLayout
    rope: RopeSpec


def check_rotation(model: PreTrainedModel, adapter: LayoutAndRope) -> None:
    """Refuse a model whose layers rotate their keys otherwise than the adapter's :class:`~kvtc.rope.RopeSpec`
    (read from the config) says: once per model object, two forward passes of one token.

    One token attends only to itself, so every layer's key is the same at any position but for the rotation: the
    key the model caches at position 0 (the unrotated key, times the rotation's attention scaling) rotated by the
    spec to :data:`ROTATION_CHECK_POSITION` must be the key the model caches there. A layer that uses no RoPE
    where the spec rotates (or the reverse, or another rotation) fails it: kvtc would store its keys wrongly
    rotated, losing compression silently. Raises :class:`~kvtc.errors.UnsupportedModel` naming the layers."""
    if model in _ROTATION_CHECKED or model in _ROTATION_CHECKING:  # done, or asked again from inside its forward
        return
    if not hasattr(model, "hf_device_map") and any(p.is_meta for p in model.parameters()):
        return  # a skeleton without weights (``torch.device("meta")``): nothing to run, nothing to store either
    lay, rope = adapter.layout, adapter.rope
    text = text_config(model.config)
    limit = int(getattr(text, "max_position_embeddings", 0) or 0)
    position = ROTATION_CHECK_POSITION if limit <= 0 else min(ROTATION_CHECK_POSITION, max(1, limit // 2))
    token = min(1, int(getattr(text, "vocab_size", 2) or 2) - 1)
    device = model.device
    keys = []
    was_training = model.training
    model.eval()
    _ROTATION_CHECKING.add(model)
    try:
        with torch.no_grad():
            for p in (0, position):
                cache = DynamicCache(config=model.config)
                model(
                    input_ids=torch.tensor([[token]], device=device),
                    position_ids=torch.tensor([[p]], device=device),
                    past_key_values=cache,
                    use_cache=True,
                )
                keys.append(torch.stack([cache.layers[li].keys[0, :, -1].float().cpu() for li in lay.layers]))
    except Exception as e:  # noqa: BLE001 - a forward pass kvtc cannot make is no reason to refuse the model
        warnings.warn(
            f"kvtc could not check the rotation of {type(model).__name__} against its config ({type(e).__name__}: "
            f"{e}); it relies on what the config says",
            stacklevel=3,
        )
        _ROTATION_CHECKED.add(model)
        return
    finally:
        _ROTATION_CHECKING.discard(model)
        model.train(was_training)
    at0, atp = (k[None, None] for k in keys)  # [1, 1 token, layers, heads, head_dim]
    pre = rope.invert(at0, torch.zeros((1, 1), dtype=torch.int64), lay.layers)
    want = rope.apply(pre, torch.full((1, 1), position, dtype=torch.int64), lay.layers)
    err = (want - atp).flatten(3).norm(dim=-1) / atp.flatten(3).norm(dim=-1).clamp_min(1e-30)  # [1, 1, layers]
    bad = [(li, float(e)) for li, e in zip(lay.layers, err.flatten().tolist(), strict=True)]
    bad = [(li, e) for li, e in bad if not e <= ROTATION_CHECK_TOLERANCE]
    if bad:
        kinds = {li: rope.layer_kinds[li] for li, _ in bad}
        raise UnsupportedModel(
            f"layers {[li for li, _ in bad]} of {type(model).__name__} rotate their keys otherwise than kvtc reads "
            f"from the config (RoPE kinds {kinds}, relative key errors {[round(e, 3) for _, e in bad]} after a "
            f"rotation to position {position}); kvtc would store those keys wrongly rotated and compress them "
            "poorly, so this model's per-layer position encoding is not supported yet"
        )
    _ROTATION_CHECKED.add(model)


__all__ = ["ROTATION_CHECK_POSITION", "ROTATION_CHECK_TOLERANCE", "check_rotation"]
