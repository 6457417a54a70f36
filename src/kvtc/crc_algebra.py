"""zlib's CRC-32 as polynomial arithmetic over GF(2): products mod P, ``x^(8·n)`` and the chunk powers.

Shared by the threaded host checksum (:mod:`kvtc.codec.crc`: ``crc32_combine``) and the GPU one
(:mod:`kvtc.kernels.triton_crc`: the powers its fold kernel weighs each chunk's CRC by); numpy only.
"""

from __future__ import annotations

import functools

import numpy as np

_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a·b mod P for reflected 32-bit polynomials."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


@functools.cache
def _x2n(k: int) -> int:
    """x^(2^k) mod P."""
    return 1 << 30 if k == 0 else _multmodp(_x2n(k - 1), _x2n(k - 1))


@functools.lru_cache(maxsize=1024)
def _shift(nbytes: int) -> int:
    """x^(8·nbytes) mod P."""
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_x2n(k), p)
        n >>= 1
        k += 1
    return p


def _multmodp_vec(a: np.ndarray, b: np.ndarray | int) -> np.ndarray:
    """:func:`_multmodp` of every element (int64 arrays holding 32-bit values)."""
    b = np.broadcast_to(np.asarray(b, dtype=np.int64), a.shape).copy()
    p = np.zeros_like(a)
    for k in range(32):
        p ^= np.where((a >> (31 - k)) & 1, b, 0)
        b = np.where(b & 1, (b >> 1) ^ _POLY, b >> 1)
    return p


def chunk_powers(chunk: int, size: int) -> np.ndarray:
    """int64 ``[size]``: x^(8·chunk·j) mod P for j = 0..size-1 (the weight of a chunk followed by j others of
    ``chunk`` bytes in a CRC of their concatenation), built by doubling."""
    out = np.zeros(max(size, 1), dtype=np.int64)
    out[0] = 1 << 31  # x^0
    have = 1
    step = _shift(chunk)  # x^(8·chunk·have), have = 1
    while have < size:
        n = min(have, size - have)
        out[have : have + n] = _multmodp_vec(out[:n], step)
        step = _multmodp(step, step)
        have += n
    return out[:size]
