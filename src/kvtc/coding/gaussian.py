"""The ``gauss`` entropy backend: fixed-step symbol planes coded under each component's Gaussian, by rANS.

A fixed-step type (:data:`kvtc.quant.FIXED_TYPES`) rounds a PCA coefficient to a multiple of its component's step
``Δ``; the calibration knows each component's variance ``λ`` (its PCA eigenvalue, in the space the codec
projects in). So a decoder knows, before reading a symbol, the distribution it comes from: ``q = round(x / Δ)``
of a centred coefficient of standard deviation ``√λ``, a discretised Gaussian of standard deviation ``s = √λ / Δ``
steps. This backend codes each plane row (one component's symbols over a run of tokens) under that distribution
with an asymmetric numeral system coder (rANS, the ``constriction`` package), so the stream costs about the
symbols' cross-entropy against the model: on Gemma-3-270M's and SmolLM2's KV about a tenth less than zstd, which
sees one byte histogram per block for components of very different spreads (docs/studies/entropy-model.md).

The model is a function of the calibration, the plan and the header alone: no table is stored. ``s`` is rounded
to :data:`GRID` steps per octave (:func:`std_index`); each index's probabilities (:func:`probabilities`: the
Gaussian's mass over each symbol's bin, the end symbols taking the tails, mixed with :data:`FLOOR` of a uniform
distribution so that any symbol, even one the quantizer never writes, can be coded) are the same on every
machine up to the last bit of ``erfc``; a stream also carries the CRC-32 of the plane bytes it codes, so that a
decoder whose model differed in a bit fails with :class:`~kvtc.errors.FormatError` instead of returning other
symbols. Rows of one index are coded together, indices in ascending order.

Stream: ``u32 crc32(raw plane bytes) · u32 words of the rANS stack`` (little-endian). The encoder uses this
backend only for a section whose coded size beats the general-purpose backend's (the container records which one
coded each section), so a blob is never larger for it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..errors import FormatError
from .buffers import new_bytes
from .packing import packed_plane_bytes, symbols_per_byte, unpack

NAME = "gauss"
#: steps of the standard-deviation grid per octave
GRID = 8
#: range of the grid (indices): ``s`` from 2^-8 to 2^12 steps
LOWEST, HIGHEST = -8 * GRID, 12 * GRID
#: weight of the uniform distribution mixed into every model
FLOOR = 2.0**-16
#: symbols a decoder takes from the coder at once (int32: 4 bytes each) and packs at once
_DECODE_SYMBOLS = 1 << 20
_PACK_SYMBOLS = 1 << 22

try:  # the rANS coder; without it the encoder keeps the general-purpose backend and such a stream cannot decode
    import constriction as _constriction

    _AnsCoder = _constriction.stream.stack.AnsCoder
    _Categorical = _constriction.stream.model.Categorical
except ImportError:  # pragma: no cover - a dependency of the package
    _constriction = None


def available() -> bool:
    """Whether this machine can code and decode ``gauss`` streams (the ``constriction`` package)."""
    return _constriction is not None


@dataclass(frozen=True)
class Hint:
    """What a ``gauss`` stream's model is built from: the planes' symbol width and packing, and for each run of
    plane rows (one PCA group's rows under one plan) its token count and each row's standard-deviation index."""

    bits: int
    packing: str
    pieces: tuple[tuple[int, np.ndarray], ...]  # (tokens, int16 [rows] std indices)

    def raw_bytes(self) -> int:
        return sum(len(ks) * packed_plane_bytes(n, self.bits, self.packing) for n, ks in self.pieces)

    def __add__(self, other: Hint) -> Hint:
        if (self.bits, self.packing) != (other.bits, other.packing):
            raise ValueError("cannot join hints of different planes")
        return Hint(self.bits, self.packing, self.pieces + other.pieces)


def std_index(std: np.ndarray | torch.Tensor) -> np.ndarray:
    """int16: each standard deviation (in steps) rounded to the grid, clamped to its range."""
    s = np.asarray(torch.as_tensor(std, dtype=torch.float64).cpu())
    with np.errstate(divide="ignore"):
        k = np.rint(GRID * np.log2(np.maximum(s, 2.0**-30)))
    return np.clip(k, LOWEST, HIGHEST).astype(np.int16)


@lru_cache(maxsize=4096)
def probabilities(bits: int, k: int) -> np.ndarray:
    """float64 ``[2^bits]``: the model of index ``k`` over a ``bits``-bit fixed-step plane's symbols
    (``q + h``, :data:`kvtc.quant.FIXED_HALF`)."""
    from ..quant import FIXED_HALF, TYPE_BITS

    half = {TYPE_BITS[t]: h for t, h in FIXED_HALF.items()}[bits]
    s = 2.0 ** (k / GRID)
    size = 1 << bits
    edges = [(q - half + 0.5) / (s * math.sqrt(2.0)) for q in range(2 * half)]  # upper edge of each bin but the last
    upper = [0.5 * math.erfc(-e) for e in edges] + [1.0]
    p = np.zeros(size, dtype=np.float64)
    lo = 0.0
    for q in range(2 * half + 1):
        p[q] = max(upper[q] - lo, 0.0)
        lo = upper[q]
    p = (1.0 - FLOOR) * p / p.sum() + FLOOR / size
    return p


@lru_cache(maxsize=4096)
def _model(bits: int, k: int) -> object:
    return _Categorical(probabilities(bits, k), perfect=False)


def _symbols(data: bytes | memoryview, hint: Hint) -> list[np.ndarray]:
    """Each piece's symbols ``[rows, tokens]`` (uint8) from the packed plane bytes (:func:`kvtc.coding.packing.unpack`)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    out, off = [], 0
    for n, ks in hint.pieces:
        width = packed_plane_bytes(n, hint.bits, hint.packing)
        block = torch.from_numpy(buf[off : off + len(ks) * width].reshape(len(ks), width).copy())
        off += len(ks) * width
        out.append(unpack(block, n, hint.bits, hint.packing).numpy())
    return out


def _pack_into(dst: np.ndarray, planes: np.ndarray, bits: int, packing: str) -> None:
    """Pack uint8 symbol ``planes [rows, n]`` into ``dst`` (uint8 ``[rows, packed_plane_bytes(n)]``), as
    :func:`kvtc.coding.packing.pack` does (low bits first, padding bits zero), a block of rows at a time in uint8
    (no wider copies of the planes)."""
    rows, n = planes.shape
    per = symbols_per_byte(bits, packing)
    if per == 1:
        dst[:] = planes
        return
    whole = n // per
    step = max(1, _PACK_SYMBOLS // max(n, 1))
    for a in range(0, rows, step):
        block = planes[a : a + step]
        out = dst[a : a + step]
        body = block[:, : whole * per].reshape(len(block), whole, per)
        out[:, :whole] = body[:, :, 0]
        for j in range(1, per):
            out[:, :whole] |= body[:, :, j] << (j * bits)
        if whole * per < n:  # the last byte's symbols, the rest of its bits zero
            tail = block[:, whole * per :]
            out[:, whole] = tail[:, 0]
            for j in range(1, tail.shape[1]):
                out[:, whole] |= tail[:, j] << (j * bits)


def _order(hint: Hint) -> list[tuple[int, list[tuple[int, int]]]]:
    """Rows grouped by model index (ascending): ``[(k, [(piece, row), ...]), ...]``."""
    by: dict[int, list[tuple[int, int]]] = {}
    for i, (_, ks) in enumerate(hint.pieces):
        for r, k in enumerate(ks.tolist()):
            by.setdefault(int(k), []).append((i, r))
    return sorted(by.items())


def compress(data: bytes | memoryview, hint: Hint) -> bytes:
    """The ``gauss`` stream of packed plane bytes ``data`` (exactly ``hint.raw_bytes()`` of them)."""
    if not available():
        raise FormatError("the gauss entropy backend needs the constriction package (`pip install constriction`)")
    if len(data) != hint.raw_bytes():
        raise ValueError(f"plane holds {len(data)} bytes, its hint describes {hint.raw_bytes()}")
    planes = _symbols(data, hint)
    coder = _AnsCoder()
    for k, rows in reversed(_order(hint)):  # a stack: the last coded is the first decoded
        sym = np.concatenate([planes[i][r] for i, r in rows]).astype(np.int32)
        coder.encode_reverse(sym, _model(hint.bits, k))
    words = coder.get_compressed().astype("<u4", copy=False)
    return (zlib.crc32(data) & 0xFFFFFFFF).to_bytes(4, "little") + words.tobytes()


def decompress(data: bytes | memoryview, raw_len: int, hint: Hint | None) -> bytes:
    """Inverse of :func:`compress`: exactly ``raw_len`` bytes, or :class:`~kvtc.errors.FormatError`."""
    if hint is None:
        raise FormatError("a gauss-coded section must be a fixed-step symbol plane; this one is not")
    if not available():
        raise FormatError("this blob's planes are gauss-coded: install the constriction package to decode it")
    if hint.raw_bytes() != raw_len:
        raise FormatError(f"gauss section declares {raw_len} bytes, its plan's planes hold {hint.raw_bytes()}")
    if len(data) < 4 or (len(data) - 4) % 4:
        raise FormatError("gauss stream is not a CRC and whole 32-bit words")
    crc = int.from_bytes(bytes(data[:4]), "little")
    words = np.frombuffer(data, dtype="<u4", offset=4).astype(np.uint32)
    planes = [np.zeros((len(ks), n), dtype=np.uint8) for n, ks in hint.pieces]
    try:
        coder = _AnsCoder(words)
        del words
        for k, rows in _order(hint):
            model = _model(hint.bits, k)
            # the rows of one model decode as one run of symbols: taken in batches of at most _DECODE_SYMBOLS
            # (bounded int32 copies), the same symbols in the same order
            batch: list[tuple[int, int, int]] = []
            total = 0
            for i, r in rows:
                c = hint.pieces[i][0]
                batch.append((i, r, c))
                total += c
                if total >= _DECODE_SYMBOLS:
                    _decode_rows(coder, model, batch, total, planes)
                    batch, total = [], 0
            if batch:
                _decode_rows(coder, model, batch, total, planes)
        empty = coder.is_empty()
    except Exception as e:  # the coder's own errors on a stream it cannot read
        raise FormatError(f"corrupt gauss stream: {e}") from None
    if not empty:
        raise FormatError("gauss stream is longer than its symbols; the blob is corrupt")
    made = new_bytes(raw_len)  # the result is written once, in place (no joined copies)
    out, dst = made if made is not None else (None, np.zeros(raw_len, dtype=np.uint8))
    off = 0
    for (n, ks), sym in zip(hint.pieces, planes):
        width = packed_plane_bytes(n, hint.bits, hint.packing)
        _pack_into(dst[off : off + len(ks) * width].reshape(len(ks), width), sym, hint.bits, hint.packing)
        off += len(ks) * width
    del planes
    result = out if out is not None else dst.tobytes()
    if zlib.crc32(result) & 0xFFFFFFFF != crc:
        raise FormatError(
            "gauss stream decoded to other planes than were coded (corrupt stream, or a calibration whose "
            "variances differ from the encoder's)"
        )
    return result


def _decode_rows(coder: object, model: object, batch: list[tuple[int, int, int]], total: int, planes: list) -> None:
    """Decode ``total`` symbols under ``model`` into the plane rows of ``batch`` (``(piece, row, count)``, in order)."""
    sym = coder.decode(model, total)  # type: ignore[attr-defined]
    off = 0
    for i, r, c in batch:
        planes[i][r] = sym[off : off + c]
        off += c


__all__ = ["FLOOR", "GRID", "NAME", "Hint", "available", "compress", "decompress", "probabilities", "std_index"]
