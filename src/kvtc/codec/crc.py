"""CRC-32 (the zlib / container checksum) of large buffers on several threads.

``zlib.crc32`` runs on one core; a blob of hundreds of MB would spend most of a GPU restore's time in it.
:func:`crc32_many` cuts buffers into pieces, checksums them on a thread pool (zlib releases the GIL) and
joins the pieces' CRCs with :func:`crc32_combine` (GF(2) polynomial arithmetic, :mod:`kvtc.crc_algebra`, as zlib's ``crc32_combine``:
``crc(A‖B) = crc(A)·x^(8·len B) mod P  ⊕  crc(B)``). The result is the ordinary CRC-32 of the whole buffer.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from ..crc_algebra import _multmodp, _shift, chunk_powers

#: buffers at least this large are checksummed in pieces of this size
PIECE = 8 << 20


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A‖B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _multmodp(_shift(len2), crc1) ^ crc2


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
