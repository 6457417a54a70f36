"""CRC-32 (zlib's) of regions of a device buffer, on the GPU: what the container records for each coded stream,
computed before the stream leaves the device, so a compressed blob's header is known before its body is copied
to the host and the body can be copied straight to its place.

Two kernels. :func:`_chunk_crc_kernel`: the standard CRC-32 of every whole 4 KiB chunk of every region, one
chunk a lane, slicing-by-4 table lookups (``crc ^= word``, then four tables indexed by its four bytes).
:func:`_fold_kernel`: per region, ``crc(c_0 ‖ … ‖ c_{n-1}) = ⊕_i crc(c_i)·x^(8·4096·(n-1-i)) mod P`` (CRC-32 is
linear: the concatenation rule zlib's ``crc32_combine`` uses, summed over every chunk at once), the powers from a
table. A region's last partial chunk is checksummed on the host (it is at most 4 KiB) and joined with
:func:`kvtc.codec.crc.crc32_combine`. Arithmetic is in int64 holding 32-bit values (no unsigned types).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

#: bytes of one chunk (one lane's work)
CHUNK = 4096
_POLY = 0xEDB88320


def _tables() -> np.ndarray:
    """int64 ``[4, 256]``: the byte table of reflected CRC-32 and its slicing-by-4 successors."""
    t = np.zeros((4, 256), dtype=np.int64)
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t[0, n] = c
    for k in range(1, 4):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t


TABLES = _tables()


# fmt: off
@triton.jit
def _chunk_crc_kernel(words_ptr, chunk_wo_ptr, nchunks, tab_ptr, out_ptr, CW: tl.constexpr, LANES: tl.constexpr):
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < nchunks
    wo = tl.load(chunk_wo_ptr + lane, mask=live, other=0)
    crc = tl.full((LANES,), 0xFFFFFFFF, tl.int64)
    for i in range(CW):
        w = tl.load(words_ptr + wo + i, mask=live, other=0).to(tl.int64) & 0xFFFFFFFF
        crc = crc ^ w
        t3 = tl.load(tab_ptr + 768 + (crc & 0xFF))
        t2 = tl.load(tab_ptr + 512 + ((crc >> 8) & 0xFF))
        t1 = tl.load(tab_ptr + 256 + ((crc >> 16) & 0xFF))
        t0 = tl.load(tab_ptr + ((crc >> 24) & 0xFF))
        crc = t0 ^ t1 ^ t2 ^ t3
    tl.store(out_ptr + lane, crc ^ 0xFFFFFFFF, mask=live)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _mulmodp(a, b):
    """a·b mod P for reflected 32-bit polynomials held in int64 (zlib's multmodp, every lane at once)."""
    p = tl.zeros_like(a)
    for k in tl.static_range(32):
        p = p ^ tl.where(((a >> (31 - k)) & 1) != 0, b, 0)
        b = tl.where((b & 1) != 0, (b >> 1) ^ 0xEDB88320, b >> 1)
    return p


@triton.jit
def _fold_kernel(crc_ptr, first_ptr, count_ptr, pow_ptr, out_ptr, LANES: tl.constexpr):
    r = tl.program_id(0)
    first = tl.load(first_ptr + r)
    n = tl.load(count_ptr + r)
    acc = tl.zeros((LANES,), tl.int64)
    for j0 in range(0, n, LANES):
        j = j0 + tl.arange(0, LANES)
        live = j < n
        c = tl.load(crc_ptr + first + j, mask=live, other=0)
        x = tl.load(pow_ptr + (n - 1 - j), mask=live, other=0)
        acc = acc ^ tl.where(live, _mulmodp(x, c), 0)
    tl.store(out_ptr + r, tl.reduce(acc, 0, _xor))
# fmt: on


_CACHE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _device_tables(device: torch.device, nchunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the lookup tables, x^(8·CHUNK·j) mod P for j < at least ``nchunks``) on ``device``, grown as needed."""
    from ..crc_algebra import chunk_powers

    key = str(device)
    got = _CACHE.get(key)
    if got is None or got[1].numel() < nchunks:
        size = max(1024, 1 << max(nchunks - 1, 1).bit_length())
        got = (torch.from_numpy(TABLES.reshape(-1)).to(device), torch.from_numpy(chunk_powers(CHUNK, size)).to(device))
        _CACHE[key] = got
    return got


def region_crcs(words: torch.Tensor, regions: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int]]:
    """Start the CRC-32 of the whole chunks of each region ``(first word, bytes)`` of the int32 device tensor
    ``words``. Returns (int64 device tensor ``[regions]``: the CRC-32 of each region's first ``bytes // CHUNK``
    chunks, 0 for none; each region's count of whole chunks). Nothing is synchronized."""
    dev = words.device
    cw = CHUNK // 4
    counts = [n // CHUNK for _, n in regions]
    total = sum(counts)
    out = torch.zeros(len(regions), dtype=torch.int64, device=dev)
    if total == 0:
        return out, counts
    tabs, pows = _device_tables(dev, max(counts))
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    starts = np.asarray([w for w, _ in regions], dtype=np.int64)
    rid = np.repeat(np.arange(len(regions)), counts)
    chunk_wo = starts[rid] + cw * (np.arange(total, dtype=np.int64) - firsts[rid])
    meta = torch.from_numpy(np.concatenate([chunk_wo, firsts, np.asarray(counts, dtype=np.int64)]))
    if dev.type == "cuda":
        meta = meta.pin_memory().to(dev, non_blocking=True)
    crcs = torch.empty(total, dtype=torch.int64, device=dev)
    lanes = 64
    _chunk_crc_kernel[(triton.cdiv(total, lanes),)](
        words, meta[:total], total, tabs, crcs, CW=cw, LANES=lanes, num_warps=2
    )
    live = [i for i, c in enumerate(counts) if c]
    sel = torch.tensor(live, dtype=torch.int64)
    first_d = meta[total : total + len(regions)][sel.to(dev)].contiguous()
    count_d = meta[total + len(regions) :][sel.to(dev)].contiguous()
    folded = torch.empty(len(live), dtype=torch.int64, device=dev)
    _fold_kernel[(len(live),)](crcs, first_d, count_d, pows, folded, LANES=256, num_warps=4)
    out[sel.to(dev)] = folded
    return out, counts


__all__ = ["CHUNK", "TABLES", "region_crcs"]
