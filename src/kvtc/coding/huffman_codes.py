"""The code tables of the ``huff4k`` entropy backend (:mod:`kvtc.coding.huffman`): length-limited Huffman code
lengths (package-merge, deterministic, so the CPU and GPU encoders build the same code from the same histogram),
canonical codes, the encoder's and decoder's lookup tables, and the nibble-packed lengths a stream starts with."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import FormatError

NAME = "huff4k"
#: longest code, in bits (the decoder's table has 2**MAX_LEN entries)
MAX_LEN = 12
#: entries of the decoder's lookup table
TABLE = 1 << MAX_LEN


# --------------------------------------------------------------------------------------------- code tables
def code_lengths(hist: Any) -> np.ndarray:
    """Code lengths (uint8 ``[256]``, 0 = absent, at most :data:`MAX_LEN`) for a byte histogram.

    Optimal length-limited prefix code by package-merge, with every tie broken by a fixed rule (leaves in
    order of (count, symbol); on equal weight a leaf sorts before a package), so the result is a pure
    function of the histogram. One symbol present: length 1. No symbol present: all zeros. The same
    function (through :func:`code_lengths_batch`) serves the CPU and the GPU encoders.
    """
    return code_lengths_batch(np.asarray(hist).reshape(1, -1))[0]  # one function for both encoders


_PAD = np.int64(1) << 44  # weight of an absent symbol in a batch: above any real package (sums < 2**44)


def code_lengths_batch(hists: Any) -> np.ndarray:
    """:func:`code_lengths` of every row of ``hists`` ``[S, 256]`` at once (uint8 ``[S, 256]``).

    Rows are padded to 256 leaves with absent symbols of weight 2**44, heavier than any real leaf or package,
    so they sort after every real item and never enter the selection: each row's result is exactly what the
    package-merge over its present symbols alone gives."""
    h = np.asarray(hists, dtype=np.int64)
    if h.ndim != 2 or h.shape[1] != 256 or (h < 0).any():
        raise ValueError("code_lengths wants rows of 256 non-negative counts")
    if (h.sum(axis=1) >= _PAD).any():
        raise ValueError("a histogram of 2**44 bytes or more")
    out = np.zeros(h.shape, dtype=np.uint8)
    present = (h > 0).sum(axis=1)
    one = np.flatnonzero(present == 1)
    out[one, np.argmax(h[one], axis=1)] = 1
    rows = np.flatnonzero(present >= 2)
    if len(rows) == 0:
        return out
    w = np.where(h[rows] > 0, h[rows], _PAD)
    order = np.argsort(w, axis=1, kind="stable")  # by (count, symbol); absent symbols last
    leaves = np.take_along_axis(w, order, axis=1)
    levels: list[np.ndarray] = []  # per merged list: is each item (in list order) a package
    cur = leaves
    for _ in range(MAX_LEN - 1):
        m = cur.shape[1] // 2
        merged = np.concatenate([leaves, cur[:, 0 : 2 * m : 2] + cur[:, 1 : 2 * m : 2]], axis=1)
        idx = np.argsort(merged, axis=1, kind="stable")  # equal weights: leaves (first in the concatenation) first
        levels.append(idx >= 256)
        cur = np.take_along_axis(merged, idx, axis=1)
    r = np.arange(len(rows))
    col = np.arange(256)[None, :]
    lengths = np.zeros((len(rows), 256), dtype=np.int64)
    take = 2 * present[rows] - 2  # items selected from the last list
    for is_pkg in reversed(levels):
        p = np.where(take > 0, np.cumsum(is_pkg, axis=1)[r, np.maximum(take - 1, 0)], 0)  # selected packages
        lengths += col < (take - p)[:, None]  # the selected leaves are the first (take - p) leaves
        take = 2 * p
    lengths += col < take[:, None]  # the first list is the leaves alone
    sub = np.zeros((len(rows), 256), dtype=np.uint8)
    np.put_along_axis(sub, order, lengths.astype(np.uint8), axis=1)
    out[rows] = sub
    return out


def check_lengths(lengths: np.ndarray) -> None:
    """Kraft: sum 2^-L == 1 (<= 1 when exactly one symbol is present)."""
    present = lengths[lengths > 0].astype(np.int64)
    if len(present) == 0:
        return
    kraft = int((np.int64(1) << (MAX_LEN - present)).sum())
    if kraft > TABLE or (len(present) > 1 and kraft != TABLE):
        raise FormatError(f"{NAME} code lengths are not a complete prefix code (Kraft sum {kraft}/{TABLE})")


_REV12 = np.array([int(f"{i:012b}"[::-1], 2) for i in range(1 << MAX_LEN)], dtype=np.int64)


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Bit-reversed canonical codes (uint32 ``[256]``; DEFLATE's assignment in (length, symbol) order)."""
    return canonical_codes_batch(np.asarray(lengths).reshape(1, -1))[0]


def canonical_codes_batch(lengths: np.ndarray) -> np.ndarray:
    """:func:`canonical_codes` of every row of ``lengths`` ``[S, 256]`` (uint32 ``[S, 256]``)."""
    ln = np.asarray(lengths, dtype=np.int64)
    onehot = ln[:, :, None] == np.arange(MAX_LEN + 1)  # [S, 256, lengths]
    bl_count = onehot.sum(axis=1)
    bl_count[:, 0] = 0
    first = np.zeros((len(ln), MAX_LEN + 1), dtype=np.int64)  # the first code of each length
    code = np.zeros(len(ln), dtype=np.int64)
    for bits in range(1, MAX_LEN + 1):
        code = (code + bl_count[:, bits - 1]) << 1
        first[:, bits] = code
    before = np.cumsum(onehot, axis=1) - onehot  # symbols below of each length
    rank = np.take_along_axis(before, ln[:, :, None], axis=2)[:, :, 0]
    codes = np.take_along_axis(first, ln, axis=1) + rank
    rev = _REV12[codes & (TABLE - 1)] >> (MAX_LEN - ln).clip(min=0)  # the code's bits, first bit lowest
    return np.where(ln > 0, rev, 0).astype(np.uint32)


def encode_table(lengths: np.ndarray) -> np.ndarray:
    """int16 ``[256]`` (what the GPU encoder looks up): reversed code | (length - 1) << 12 of each present
    byte (absent bytes: 0, never looked up)."""
    return encode_tables(np.asarray(lengths).reshape(1, -1))[0]


def encode_tables(lengths: np.ndarray) -> np.ndarray:
    """:func:`encode_table` of every row of ``lengths`` ``[S, 256]`` (int16 ``[S, 256]``)."""
    ln = np.asarray(lengths, dtype=np.int64)
    e = canonical_codes_batch(ln).astype(np.int64) | ((ln - 1).clip(min=0) << 12)
    return np.where(ln > 0, e, 0).astype(np.uint16).view(np.int16)


def decode_table(lengths: np.ndarray) -> np.ndarray:
    """int32 ``[4096]``: symbol | length << 8 for every 12-bit LSB-first peek; 0 marks a hole."""
    return decode_tables(np.asarray(lengths).reshape(1, -1))[0]


def decode_tables(lengths: np.ndarray) -> np.ndarray:
    """:func:`decode_table` of every row of ``lengths`` ``[S, 256]`` (int32 ``[S, 4096]``), vectorized: each
    present symbol of length L fills the 2^(12-L) peeks whose low L bits are its reversed code."""
    ln = np.asarray(lengths, dtype=np.int64).reshape(-1, 256)
    codes = canonical_codes_batch(ln).astype(np.int64)
    table = np.zeros((len(ln), TABLE), dtype=np.int32)
    row, sym = np.nonzero(ln)
    if len(row):
        length = ln[row, sym]
        count = np.int64(1) << (MAX_LEN - length)
        first = np.cumsum(count) - count
        rep = np.repeat(np.arange(len(row)), count)
        j = np.arange(int(count.sum()), dtype=np.int64) - first[rep]
        idx = codes[row, sym][rep] + (j << length[rep])
        table[row[rep], idx] = (sym | (length << 8))[rep]
    return table


def pack_lengths(lengths: np.ndarray) -> bytes:
    ln = np.asarray(lengths, dtype=np.uint8)
    return (ln[0::2] | (ln[1::2] << 4)).astype(np.uint8).tobytes()


def unpack_lengths(head: bytes | memoryview) -> np.ndarray:
    b = np.frombuffer(head, dtype=np.uint8, count=128)
    out = np.empty(256, dtype=np.uint8)
    out[0::2] = b & 15
    out[1::2] = b >> 4
    return out
