"""Coding the middle tokens less their token-map prediction (container version 5).

With a calibration that carries a token map (:mod:`kvtc.calibration.token_map`), the encoder subtracts from each
coded (middle) token of each layer the map's prediction from the blob's token ids and codes what is left; the blob
carries the ids (section ``tokens``, int32 ``[B, T]``), and the decoder adds the same prediction back. Tokens stored
raw (sinks, the recent window) and tokens a layer does not hold are never touched, so they stay exact.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..calibration.token_map import TokenMap
from ..errors import CalibrationError, FormatError
from ..layout import KVSlice
from . import container
from .entropy import decode_stream
from .header import Header

#: the section holding the token ids
SECTION = "tokens"


def check_ids(token_ids: Any, batch: int, tokens: int) -> torch.Tensor:
    """``token_ids`` as int64 ``[batch, tokens]`` on the CPU; a :class:`~kvtc.errors.CalibrationError` that says what
    to pass when they are missing or of another shape."""
    if token_ids is None:
        raise CalibrationError(
            "this calibration codes each token's K/V less a prediction from its token ids: pass token_ids=<int "
            f"[batch, tokens] = [{batch}, {tokens}], the ids the KV was computed from> (compress_cache: input_ids=)"
        )
    ids = torch.as_tensor(token_ids)
    if ids.dim() == 1 and batch == 1:
        ids = ids[None]
    if tuple(ids.shape) != (batch, tokens) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise CalibrationError(
            f"token_ids must be integers [batch, tokens] = [{batch}, {tokens}], got {ids.dtype} {list(ids.shape)}"
        )
    return ids.to(device="cpu", dtype=torch.int64)


def ids_bytes(ids: torch.Tensor) -> bytes:
    """The ``tokens`` section's raw bytes: int32 little-endian."""
    return ids.to(torch.int32).numpy().astype("<i4").tobytes()


def section_ids(data: Any, header: Header) -> torch.Tensor:
    """int64 ``[B, T]`` from a decoded ``tokens`` section (bytes or a uint8 tensor)."""
    raw = data.cpu().numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)
    if len(raw) != 4 * header.batch * header.tokens:
        raise FormatError(f"section {SECTION}: {len(raw)} bytes for {header.batch}x{header.tokens} token ids")
    ids = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    return torch.from_numpy(ids).view(header.batch, header.tokens)


def read_ids(blob: Any, header: Header, body: int) -> torch.Tensor:
    """A version-5 blob's token ids, read from its ``tokens`` section alone (checksum checked)."""
    chunks, _ = container.section_chunks(blob, header, body)
    for s, chunk in zip(header.sections, chunks):
        if s.name == SECTION:
            if s.raw != 4 * header.batch * header.tokens:  # checked before anything is decoded or allocated
                raise FormatError(f"section {SECTION}: {s.raw} bytes declared for {header.batch}x{header.tokens} ids")
            if zlib.crc32(chunk) != s.crc32:
                raise FormatError(f"section {SECTION}: checksum mismatch; the blob is corrupt")
            return section_ids(decode_stream(bytes(chunk), s.backend, s.raw, None), header)
    raise FormatError(f"a blob with token ids lacks its {SECTION} section; the blob is corrupt")


def coded_spans(header: Header) -> list[tuple[list[int], int, int]]:
    """``(layer positions, first, end)`` per span of layers that code tokens: tokens ``first`` to ``end`` of each
    of those layers are coded."""
    return [(list(sp.indices), first + s, first + s + m) for sp, first, s, w, m in header.spans if m]


def _columns(header: Header, positions: list[int]) -> torch.Tensor:
    per = len(header.layout.heads) * header.layout.head_dim
    return torch.cat([torch.arange(i * per, (i + 1) * per) for i in positions])


def shift(
    kv: KVSlice, header: Header, token_map: TokenMap, emb: torch.Tensor, ids: torch.Tensor, sign: float
) -> KVSlice:
    """``kv`` with ``sign`` times the prediction added to each layer's coded tokens (new tensors, same dtype)."""
    lay = header.layout
    dev = kv.keys.device
    x = token_map.features(emb, ids, dev)
    out = {"keys": kv.keys.clone(), "values": kv.values.clone()}
    B, H, D = kv.batch, len(lay.heads), lay.head_dim
    for positions, a, b in coded_spans(header):
        cols = _columns(header, positions)
        idx = torch.tensor(positions, device=dev)
        for kind, t in out.items():
            p = token_map.predict(x[:, a:b], kind, cols).view(B, b - a, len(positions), H, D)
            part = t[:, a:b].index_select(2, idx).float() + sign * p
            t[:, a:b].index_copy_(2, idx, part.to(t.dtype))
    return KVSlice(kv.layout, out["keys"], out["values"], kv.positions, kv.model_id, ids)


def add_to_layers(
    layers: Iterator[tuple[int, torch.Tensor, torch.Tensor]],
    header: Header,
    token_map: TokenMap,
    emb: torch.Tensor,
    ids: torch.Tensor,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """:meth:`~kvtc.codec.Codec.decode_layers`'s layers with the prediction added to their coded tokens."""
    lay = header.layout
    span_of = {i: (a, b) for positions, a, b in coded_spans(header) for i in positions}
    x = None
    for layer, k, v in layers:
        li = lay.layers.index(layer)
        if li in span_of:
            a, b = span_of[li]
            if x is None:
                x = token_map.features(emb, ids, k.device)
            cols = _columns(header, [li])
            for t, kind in ((k, "keys"), (v, "values")):
                p = token_map.predict(x[:, a:b], kind, cols).view(t.shape[0], b - a, *t.shape[2:])
                t[:, a:b] = (t[:, a:b].float() + p).to(t.dtype)
        yield layer, k, v


__all__ = ["SECTION", "add_to_layers", "check_ids", "coded_spans", "ids_bytes", "read_ids", "section_ids", "shift"]
