"""CRC-32 (the zlib / container checksum) of large buffers on several threads.

``zlib.crc32`` runs on one core; a blob of hundreds of MB would spend most of a GPU restore's time in it.
:func:`crc32_many` cuts buffers into pieces, checksums them on a thread pool (zlib releases the GIL) and
joins the pieces' CRCs with :func:`crc32_combine` (GF(2) polynomial arithmetic, as zlib's ``crc32_combine``:
``crc(A‖B) = crc(A)·x^(8·len B) mod P  ⊕  crc(B)``). The result is the ordinary CRC-32 of the whole buffer.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np

_POLY = 0xEDB88320  # reflected CRC-32 polynomial
#: buffers at least this large are checksummed in pieces of this size
PIECE = 8 << 20


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


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A‖B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _multmodp(_shift(len2), crc1) ^ crc2


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


@functools.lru_cache(maxsize=1)
def default_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(2, min(32, os.cpu_count() or 2)), thread_name_prefix="kvtc-crc")


class Pending:
    """CRC-32s being computed on a pool; :meth:`result` joins the pieces (blocks until they are done)."""

    def __init__(self, buffers: Sequence[memoryview | bytes], pool: Executor | None, piece: int = PIECE):
        pool = pool or default_pool()
        self.n = len(buffers)
        self.pieces: list[tuple[int, int, object]] = []  # (buffer, piece length, future or value)
        for i, b in enumerate(buffers):
            mv = memoryview(b).cast("B") if not isinstance(b, bytes) else memoryview(b)
            for off in range(0, max(len(mv), 1), piece):
                part = mv[off : off + piece]
                job = pool.submit(zlib.crc32, part) if len(part) >= (1 << 16) else zlib.crc32(part)
                self.pieces.append((i, len(part), job))

    def result(self) -> list[int]:
        out = [0] * self.n
        started = [False] * self.n
        for i, n, job in self.pieces:
            c = job if isinstance(job, int) else job.result()  # type: ignore[attr-defined]
            out[i] = crc32_combine(out[i], c, n) if started[i] else c
            started[i] = True
        return out


def crc32_submit(buffers: Sequence[memoryview | bytes], pool: Executor | None = None, piece: int = PIECE) -> Pending:
    """Start the CRC-32 of each buffer (all pieces of all buffers on ``pool`` at once). ``piece``: bytes per
    piece; larger pieces make the pool's threads take Python's lock less often (a thread parsing meanwhile then
    waits less for it)."""
    if piece < 1:
        raise ValueError("piece must be positive")
    return Pending(buffers, pool, piece)


def crc32_many(buffers: Sequence[memoryview | bytes], pool: Executor | None = None) -> list[int]:
    """CRC-32 of each buffer, computed in pieces on ``pool``."""
    return Pending(buffers, pool).result()


__all__ = ["Pending", "chunk_powers", "crc32_combine", "crc32_many", "crc32_submit", "default_pool", "PIECE"]
