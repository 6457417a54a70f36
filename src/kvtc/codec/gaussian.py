"""The ``gauss`` entropy backend: fixed-step symbol planes coded under each component's Gaussian, by rANS.

A fixed-step type (:data:`kvtc.quant.FIXED_TYPES`) rounds a PCA coefficient to a multiple of its component's step
``Δ``; the calibration knows each component's variance ``λ`` (its PCA eigenvalue, in the space the codec
projects in). So a decoder knows, before reading a symbol, the distribution it comes from: ``q = round(x / Δ)``
of a centred coefficient of standard deviation ``√λ``, a discretised Gaussian of standard deviation ``s = √λ / Δ``
steps. This backend codes each plane row (one component's symbols over a run of tokens) under that distribution
with an asymmetric numeral system coder (rANS, the ``constriction`` package), so the stream costs about the
symbols' cross-entropy against the model: on Gemma-3-270M's and SmolLM2's KV about a tenth less than zstd, which
sees one byte histogram per block for components of very different spreads (BENCHMARKS.md "Entropy coding under
the calibration's Gaussians").

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
from .packing import pack, packed_plane_bytes, unpack

NAME = "gauss"
#: steps of the standard-deviation grid per octave
GRID = 8
#: range of the grid (indices): ``s`` from 2^-8 to 2^12 steps
LOWEST, HIGHEST = -8 * GRID, 12 * GRID
#: weight of the uniform distribution mixed into every model
FLOOR = 2.0**-16

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
    """Each piece's symbols ``[rows, tokens]`` (uint8) from the packed plane bytes (:func:`kvtc.codec.packing.unpack`)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    out, off = [], 0
    for n, ks in hint.pieces:
        width = packed_plane_bytes(n, hint.bits, hint.packing)
        block = torch.from_numpy(buf[off : off + len(ks) * width].reshape(len(ks), width).copy())
        off += len(ks) * width
        out.append(unpack(block, n, hint.bits, hint.packing).numpy())
    return out


def _packed(planes: list[np.ndarray], hint: Hint) -> bytes:
    """Inverse of :func:`_symbols` (:func:`kvtc.codec.packing.pack`: padding bits zero)."""
    return b"".join(pack(torch.from_numpy(sym), hint.bits, hint.packing).numpy().tobytes() for sym in planes)


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
        for k, rows in _order(hint):
            counts = [hint.pieces[i][0] for i, _ in rows]
            sym = coder.decode(_model(hint.bits, k), int(sum(counts)))
            off = 0
            for (i, r), c in zip(rows, counts):
                planes[i][r] = sym[off : off + c]
                off += c
        empty = coder.is_empty()
    except Exception as e:  # the coder's own errors on a stream it cannot read
        raise FormatError(f"corrupt gauss stream: {e}") from None
    if not empty:
        raise FormatError("gauss stream is longer than its symbols; the blob is corrupt")
    out = _packed(planes, hint)
    if zlib.crc32(out) & 0xFFFFFFFF != crc:
        raise FormatError(
            "gauss stream decoded to other planes than were coded (corrupt stream, or a calibration whose "
            "variances differ from the encoder's)"
        )
    return out


__all__ = ["FLOOR", "GRID", "NAME", "Hint", "available", "compress", "decompress", "probabilities", "std_index"]
