"""What a blob holds and how large each part is, read from its header alone (``kvtc inspect``, eval's byte counts)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import FormatError
from ..layout import DTYPES
from . import container


def inspect(blob: bytes | memoryview | torch.Tensor) -> dict[str, Any]:
    """Header facts and sizes of a blob, without decoding it (needs no calibration).

    ``original_bytes``: the keys and values the layers hold, in the blob's dtype (a sliding-window layer holds only
    its newest tokens); ``middle_bytes`` of them are coded into ``coded_bytes`` (every byte of the blob but the raw
    sinks and window: header, positions, range parameters, coded planes), so ``codec_ratio`` is
    ``middle_bytes / coded_bytes`` and ``whole_cache_ratio`` is ``original_bytes / bytes``. ``spans``: per set of
    layers holding the same tokens, how many each holds, stores raw and codes.
    """
    if isinstance(blob, torch.Tensor):
        if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.device.type != "cpu":
            raise FormatError("a tensor blob must be a 1-D uint8 CPU tensor (e.g. pinned host memory)")
        blob = memoryview(blob.contiguous().numpy())
    header, body = container.read_header(blob)
    lay = header.layout
    esize = torch.empty((), dtype=DTYPES[lay.dtype]).element_size()
    s, w = header.protected
    B, T, N = header.batch, header.tokens, header.middle_tokens
    per_layer_token = 2 * len(lay.heads) * lay.head_dim * esize
    raw_secs = [x for x in header.sections if x.name.startswith("raw.")]
    coded = [x for x in header.sections if not x.name.startswith("raw.")]
    overhead = body  # prefix + header
    coded_layer_tokens = sum(m * len(sp.indices) for sp, *_, m in header.spans)
    mid_orig = B * coded_layer_tokens * per_layer_token
    mid_before = overhead + sum(x.raw for x in coded)
    mid_after = overhead + sum(x.coded for x in coded)
    held = header.held_bytes()
    # a "middle token" is one token of every layer: layers that hold fewer tokens count by the share they code
    mid_tokens = B * coded_layer_tokens / len(lay.layers)
    return {
        "mode": header.mode,
        "version": header.version,
        "calibration": header.calibration,
        "model_id": header.model_id,
        "layout": lay.to_dict(),
        "batch": B,
        "tokens": T,
        "sinks": s,
        "window": w,
        "middle_tokens": N,
        "spans": [
            {
                "layers": [lay.layers[i] for i in sp.indices],
                "max_tokens": sp.limit,
                "held": sp.held(T),
                "sinks": ss,
                "window": ww,
                "coded": m,
            }
            for sp, _, ss, ww, m in header.spans
        ],
        "target_ratio": header.ratio,
        "tiers": None if not header.tiers else dict(zip(("high", "low", "share"), header.tiers)),
        "rungs": None if not header.rungs else {"ratios": list(header.rungs), "counts": header.rung_counts},
        "packing": header.packing,
        "bytes": len(blob),
        "header_bytes": overhead,
        "original_bytes": held,
        "middle_bytes": mid_orig,
        "coded_bytes": mid_after if coded_layer_tokens else 0,
        "whole_cache_ratio": held / len(blob),
        "codec_ratio_before_entropy": mid_orig / mid_before if coded_layer_tokens else None,
        "codec_ratio": mid_orig / mid_after if coded_layer_tokens else None,
        "bytes_per_middle_token": mid_after / mid_tokens if coded_layer_tokens else None,
        "raw_bytes": sum(x.coded for x in raw_secs),
        "sections": [{"name": x.name, "backend": x.backend, "raw": x.raw, "coded": x.coded} for x in header.sections],
    }
