"""The two digests of a calibration file.

* ``hash`` names the calibration: blobs carry it (a blob is decoded only with the calibration that encoded it) and
  stores key their namespaces by it. It is :func:`decoding_hash`, the SHA-256 of exactly what decoding depends on:
  layout, PCA grouping, RoPE spec, every plan's segments and clips (by ratio, kind and group) and the ``mean``,
  ``basis`` (float16) and ``scale`` tensors as the file stores them (each dtype hashed with its bytes). Statistics,
  timings, corpus notes, model id, library version, eigenvalues, ``total_variance``/``samples`` and the DP's
  predicted errors are left out, so recalibrating the same recipe on the same data gives the same hash.
* ``checksum`` guards the file: :func:`content_hash` over all the metadata but the checksum itself and every
  tensor, so a changed byte anywhere is refused on load.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

#: names the definition of a version-4 content hash (hashed with the content, so a new definition is a new name)
CONTENT_HASH = "kvtc-calibration-content/4"
KINDS = ("keys", "values")


def content_hash(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], skip: str = "hash") -> str:
    """SHA-256 of the canonical JSON of ``meta`` (without its ``skip`` entry) followed by every tensor's name,
    dtype, shape and bytes in name order."""
    h = hashlib.sha256()
    meta = {k: v for k, v in meta.items() if k != skip}
    h.update(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def decoding_hash(
    layout: Any,
    grouping: Any,
    rope: dict[str, Any] | None,
    plans: Mapping[str, Mapping[str, list[Any]]],
    tensors: Mapping[str, torch.Tensor],
) -> str:
    """The version-4 content hash of a calibration (``tensors`` as the file stores them, eigenvalues ignored)."""
    described = {
        "format": "kvtc-calibration",
        "content": CONTENT_HASH,
        "layout": layout.to_dict(),
        "grouping": grouping.to_dict(),
        "rope": rope,
        "plans": {
            key: {
                kind: [
                    {"segments": [list(seg) for seg in pl.segments], "clips": pl.kept_clips()} for pl in by_kind[kind]
                ]
                for kind in KINDS
            }
            for key, by_kind in plans.items()
        },
    }
    return content_hash(described, {n: t for n, t in tensors.items() if not n.endswith(".eigenvalues")})


__all__ = ["CONTENT_HASH", "content_hash", "decoding_hash"]
