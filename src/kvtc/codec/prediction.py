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
from ..coding.buffers import MIN_CHUNK_ROWS, Scratch, chunk_bytes, chunk_rows, row_chunks
from ..coding.entropy import decode_stream
from ..errors import CalibrationError, FormatError
from ..layout import KVSlice
from . import container
from .budget import decoded_output_bytes
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
    kv: KVSlice,
    header: Header,
    token_map: TokenMap,
    emb: torch.Tensor,
    ids: torch.Tensor,
    sign: float,
    inplace: bool = False,
) -> KVSlice:
    """``kv`` with ``sign`` times the prediction added to each layer's coded tokens (new tensors, same dtype;
    ``inplace``: added into ``kv``'s own tensors, for a caller that owns them, such as a decode). The prediction is
    computed a chunk of a span's tokens at a time (:func:`feature_chunks`, chunks of
    :func:`~kvtc.coding.buffers.chunk_bytes` of the decode), each chunk's product over at least
    :data:`~kvtc.coding.buffers.MIN_CHUNK_ROWS` rows: the same bits as one product."""
    lay = header.layout
    dev = kv.keys.device
    check_vocabulary(token_map, emb, ids, dev)
    chunk = chunk_bytes(decoded_output_bytes(header), 16)  # (only the result is held beside it)
    out = {"keys": kv.keys, "values": kv.values}
    if not inplace:
        out = {k: t.clone() for k, t in out.items()}
    B, H, D = kv.batch, len(lay.heads), lay.head_dim
    work = Scratch()  # the chunks' buffers, allocated once
    for positions, a, b in coded_spans(header):
        cols = _columns(header, positions)
        part_map = token_map.columns(cols)  # the spans' weight columns, gathered once
        idx = torch.tensor(positions, device=dev)
        for t0, t1, x in feature_chunks(token_map, emb, ids, a, b, len(cols), dev, chunk):
            shape = (B, t1 - t0, len(positions), H, D)
            for kind, t in out.items():
                p = part_map.predict(x, kind).view(shape)
                if sign != 1.0:
                    p.mul_(sign)
                held = torch.index_select(t[:, t0:t1], 2, idx, out=work.tensor("held", shape, t.dtype, dev))
                part = work.tensor("part", shape, torch.float32, dev).copy_(held)
                part.add_(p)  # (in place: the bits of part + sign * p)
                del p
                t[:, t0:t1].index_copy_(2, idx, held.copy_(part))
    return KVSlice(kv.layout, out["keys"], out["values"], kv.positions, kv.model_id, ids)


def add_to_layer_list(
    layers: list[tuple[int, torch.Tensor, torch.Tensor]],
    header: Header,
    token_map: TokenMap,
    emb: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    """:func:`add_to_layers` on layers already decoded (each layer's own ``[B, T, H, D]`` tensors, added in place),
    token chunk by token chunk as :func:`shift` does."""
    if not layers:
        return
    dev = layers[0][1].device
    check_vocabulary(token_map, emb, ids, dev)
    chunk = chunk_bytes(decoded_output_bytes(header), 16)  # (only the result is held beside it)
    lay = header.layout
    work = Scratch()  # the chunks' buffers, allocated once
    for positions, a, b in coded_spans(header):
        maps = [(li, token_map.columns(_columns(header, [li]))) for li in positions]
        per = len(lay.heads) * lay.head_dim
        for t0, t1, x in feature_chunks(token_map, emb, ids, a, b, per, dev, chunk):
            for li, part_map in maps:
                _, k, v = layers[li]
                for t, kind in ((k, "keys"), (v, "values")):
                    shape = (t.shape[0], t1 - t0, *t.shape[2:])
                    p = part_map.predict(x, kind).view(shape)
                    part = work.tensor("part", shape, torch.float32, dev).copy_(t[:, t0:t1])
                    t[:, t0:t1] = part.add_(p)
                    del p


def check_vocabulary(token_map: TokenMap, emb: torch.Tensor, ids: torch.Tensor, device: torch.device) -> None:
    """Raise :class:`~kvtc.errors.CalibrationMismatch` where any of ``ids`` lies outside the map's vocabulary (as
    :meth:`TokenMap.features` of all of them would, before any is computed)."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= token_map.vocab):
        token_map.features(emb, ids, device)  # raises, naming the vocabulary


def feature_chunks(
    token_map: TokenMap,
    emb: torch.Tensor,
    ids: torch.Tensor,
    a: int,
    b: int,
    columns: int,
    device: torch.device,
    chunk: int | None = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(t0, t1, features of tokens [t0, t1))`` over tokens ``[a, b)`` of ``ids [B, T]``, in chunks whose float32
    predictions of ``columns`` features take about ``chunk`` bytes (default
    :data:`~kvtc.coding.buffers.CHUNK_BYTES`; at least :data:`~kvtc.coding.buffers.MIN_CHUNK_ROWS` rows, or all):
    each token's features are those :meth:`TokenMap.features` gives it among all the ids (its lags read from the
    tokens before the chunk)."""
    B = ids.shape[0]
    lags = token_map.lags
    f = lags * token_map.dim
    least = -(-MIN_CHUNK_ROWS // max(B, 1))
    # per row: the prediction (columns), the features and their lagged parts (a few times f)
    step = max(least, chunk_rows(4 * max(columns, 2 * f), chunk) // max(B, 1))
    for t0, t1 in row_chunks(b - a, step, least):
        t0, t1 = a + t0, a + t1
        lo = max(t0 - (lags - 1), 0)
        x = token_map.features(emb, ids[:, lo:t1], device)
        yield t0, t1, x[:, t0 - lo :].contiguous()


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


__all__ = [
    "SECTION",
    "add_to_layer_list",
    "add_to_layers",
    "check_ids",
    "check_vocabulary",
    "coded_spans",
    "feature_chunks",
    "ids_bytes",
    "read_ids",
    "section_ids",
    "shift",
]
