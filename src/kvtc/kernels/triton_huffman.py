"""Triton kernels of the ``huff4k`` entropy backend (format: :mod:`kvtc.coding.huffman`, docs/FORMAT.md).

Every 4 KiB block is coded independently from a 32-bit word boundary, so one GPU thread (a "lane") codes or
decodes one whole block, sequentially; a program holds ``lanes`` lanes. Streams with different code tables
share one launch: each block carries its own offsets (source bytes, output words, table).

* :func:`block_hist`: the byte histogram of each block (one program per block, ``tl.histogram``; a
  tensor-core fallback multiplies the one-hot matrices of the bytes' nibbles). The host sums them per
  stream (the code tables); :func:`block_bits` multiplies them by the code lengths: each block's bits, so
  its word count and, by an exclusive cumulative sum, its first output word.
* :func:`encode`: per lane, the block's bytes ``vec`` (4 or 8) at a time (the next vector loaded ahead with
  ``prefetch``), each byte's bit-reversed code and length from the stream's table, appended LSB-first to a
  64-bit bit buffer; a full 32-bit word is stored whenever the buffer holds 32 bits or more (checked every
  2 bytes: 31 + 2 * 12 < 64), the remainder at the end.
* :func:`decode`: per lane, a 64-bit bit buffer refilled one word at a time when it holds fewer than 32 bits
  (the next word loaded ahead with ``prefetch``; words past the block's count read as 0, nothing outside
  the block is read); its low 12 bits index the stream's 4096-entry table of (symbol, length); ``vec``
  symbols are packed into one 32- or 64-bit store. A table hole, a block that does not end within exactly
  its words, or nonzero padding bits set the error flag (an int32 the host reads back: FormatError).

Tables are int16: encode ``[streams * 256]`` code | (length - 1) << 12; decode ``[streams * 4096]``
symbol | length << 8 (0: a hole). Coded words are int32 (the bits of little-endian uint32 words).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _block_hist_kernel(src_ptr, blk_src_ptr, blk_n_ptr, hist_ptr, BLOCK: tl.constexpr):
    """Byte histogram of one block with ``tl.histogram``, the block read as 32-bit words; bytes past the
    block's end count as zeros and are taken off bin 0 again (no masked histogram needed)."""
    b = tl.program_id(0)
    s0 = tl.load(blk_src_ptr + b)  # a multiple of 4 (of 8, in fact)
    n = tl.load(blk_n_ptr + b)
    j = tl.arange(0, BLOCK // 4)
    w = tl.load(src_ptr.to(tl.pointer_type(tl.int32)) + s0 // 4 + j, mask=4 * j < n, other=0)
    w = w.to(tl.uint32, bitcast=True)
    h = tl.histogram(tl.where(4 * j < n, w & 0xFF, 0).to(tl.int32), 256)
    h += tl.histogram(tl.where(4 * j + 1 < n, (w >> 8) & 0xFF, 0).to(tl.int32), 256)
    h += tl.histogram(tl.where(4 * j + 2 < n, (w >> 16) & 0xFF, 0).to(tl.int32), 256)
    h += tl.histogram(tl.where(4 * j + 3 < n, w >> 24, 0).to(tl.int32), 256)
    bins = tl.arange(0, 256)
    h = h - tl.where(bins == 0, BLOCK - n, 0)
    tl.store(hist_ptr + b.to(tl.int64) * 256 + bins, h)


@triton.jit
def _block_hist_onehot_kernel(src_ptr, blk_src_ptr, blk_n_ptr, hist_ptr, BLOCK: tl.constexpr, K: tl.constexpr):
    """The same histogram as a product of one-hot matrices: count[h, l] = sum_i [hi_i = h][lo_i = l] over
    the bytes' nibbles, on the tensor cores (int8 x int8 -> int32, exact). A fallback: slower on an H200."""
    b = tl.program_id(0)
    s0 = tl.load(blk_src_ptr + b)
    n = tl.load(blk_n_ptr + b)
    r16 = tl.arange(0, 16)
    acc = tl.zeros([16, 16], dtype=tl.int32)
    for k in range(0, BLOCK, K):
        i = k + tl.arange(0, K)
        m = i < n
        x = tl.load(src_ptr + s0 + i, mask=m, other=0).to(tl.int32)
        hi = tl.where(m, x >> 4, 16)  # past the end: no row
        lo = x & 15
        a = (r16[:, None] == hi[None, :]).to(tl.int8)
        c = (lo[:, None] == r16[None, :]).to(tl.int8)
        acc = tl.dot(a, c, acc, out_dtype=tl.int32)
    tl.store(hist_ptr + b.to(tl.int64) * 256 + r16[:, None] * 16 + r16[None, :], acc)


@triton.jit
def _block_bits_kernel(hist_ptr, blk_tab_ptr, len_ptr, bits_ptr, nblocks, ROWS: tl.constexpr):
    """Coded bits of each block: its histogram times its stream's code lengths."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m = rows < nblocks
    toff = tl.load(blk_tab_ptr + rows, mask=m, other=0)
    cols = tl.arange(0, 256)
    h = tl.load(hist_ptr + rows.to(tl.int64)[:, None] * 256 + cols[None, :], mask=m[:, None], other=0)
    ln = tl.load(len_ptr + toff[:, None] + cols[None, :], mask=m[:, None], other=0)
    tl.store(bits_ptr + rows, tl.sum(h * ln, axis=1), mask=m)


# fmt: off
@triton.jit
def _encode_kernel(
    src_ptr, blk_src_ptr, blk_n_ptr, blk_tab_ptr, etab_ptr, blk_wo_ptr, out_ptr, nblocks, BLOCK: tl.constexpr,
    LANES: tl.constexpr, VEC: tl.constexpr, PREFETCH: tl.constexpr
):
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < nblocks
    s0 = tl.load(blk_src_ptr + lane, mask=live, other=0)  # int64 byte offset from src_ptr, a multiple of VEC
    n = tl.load(blk_n_ptr + lane, mask=live, other=0)
    toff = tl.load(blk_tab_ptr + lane, mask=live, other=0)
    wp = tl.load(blk_wo_ptr + lane, mask=live, other=0)  # int64: next output word of the lane
    if VEC == 4:
        vptr = src_ptr.to(tl.pointer_type(tl.int32)) + s0 // 4
    else:
        vptr = src_ptr.to(tl.pointer_type(tl.int64)) + s0 // 8
    acc = tl.zeros([LANES], dtype=tl.uint64)
    nbits = tl.zeros([LANES], dtype=tl.int32)
    nxt = tl.load(vptr, mask=n > 0, other=0)
    for i in range(0, BLOCK, VEC):
        if PREFETCH:  # load the next vector now: its latency hides behind this one's codes
            raw = nxt
            nxt = tl.load(vptr + (i // VEC + 1), mask=i + VEC < n, other=0)
        else:
            raw = tl.load(vptr + i // VEC, mask=i < n, other=0)
        if VEC == 4:
            vec = raw.to(tl.uint32, bitcast=True)
        else:
            vec = raw.to(tl.uint64, bitcast=True)
        for k in tl.static_range(VEC):
            x = ((vec >> (8 * k)) & 0xFF).to(tl.int32)
            e = tl.load(etab_ptr + toff + x, mask=live, other=0).to(tl.int32) & 0xFFFF
            act = i + k < n
            ln = tl.where(act, (e >> 12) + 1, 0)
            code = tl.where(act, e & 0xFFF, 0)
            acc = acc | (code.to(tl.uint64) << nbits.to(tl.uint64))
            nbits = nbits + ln
            if k % 2 == 1:  # the buffer held < 32 bits, plus 2 codes of <= 12: at most one full word
                full = nbits >= 32
                tl.store(out_ptr + wp, (acc & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True), mask=full & live)
                acc = tl.where(full, acc >> 32, acc)
                nbits = tl.where(full, nbits - 32, nbits)
                wp = wp + full.to(tl.int64)
    tl.store(out_ptr + wp, (acc & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True), mask=(nbits > 0) & live)
# fmt: on


# fmt: off
@triton.jit
def _decode_kernel(
    words_ptr, blk_wo_ptr, blk_nw_ptr, blk_n_ptr, blk_tab_ptr, blk_out_ptr, dtab_ptr, out_ptr, err_ptr, nblocks,
    BLOCK: tl.constexpr, LANES: tl.constexpr, TABLE: tl.constexpr, VEC: tl.constexpr, PREFETCH: tl.constexpr
):
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < nblocks
    wo = tl.load(blk_wo_ptr + lane, mask=live, other=0)  # int64 first word of the block
    nw = tl.load(blk_nw_ptr + lane, mask=live, other=0)
    n = tl.load(blk_n_ptr + lane, mask=live, other=0)
    toff = tl.load(blk_tab_ptr + lane, mask=live, other=0)
    ob = tl.load(blk_out_ptr + lane, mask=live, other=0) // VEC  # int64 first output vector
    acc = tl.zeros([LANES], dtype=tl.uint64)
    nbits = tl.zeros([LANES], dtype=tl.int32)  # bits in the buffer
    rd = tl.zeros([LANES], dtype=tl.int32)  # words taken into the buffer (past the end: zeros)
    used = tl.zeros([LANES], dtype=tl.int32)  # bits consumed
    bad = tl.zeros([LANES], dtype=tl.int32)
    nxt = tl.load(words_ptr + wo, mask=(nw > 0) & live, other=0)  # the word at rd, loaded ahead
    for i in range(0, BLOCK, VEC):
        if VEC == 4:
            packed = tl.zeros([LANES], dtype=tl.uint32)
        else:
            packed = tl.zeros([LANES], dtype=tl.uint64)
        for k in tl.static_range(VEC):
            if k % 2 == 0:  # keep >= 32 bits buffered: enough for 2 codes of <= 12 bits
                need = nbits < 32
                if PREFETCH:
                    wd = nxt
                else:
                    wd = tl.load(words_ptr + wo + rd, mask=need & (rd < nw) & live, other=0)
                wd64 = wd.to(tl.uint32, bitcast=True).to(tl.uint64)
                acc = tl.where(need, acc | (wd64 << nbits.to(tl.uint64)), acc)
                nbits = tl.where(need, nbits + 32, nbits)
                rd = tl.where(need, rd + 1, rd)
                if PREFETCH:
                    nxt = tl.load(words_ptr + wo + rd, mask=need & (rd < nw) & live, other=0)
                    nxt = tl.where(need, nxt, wd)
            x = (acc & (TABLE - 1)).to(tl.int32)
            e = tl.load(dtab_ptr + toff + x, mask=live, other=0).to(tl.int32) & 0xFFFF
            act = (i + k) < n
            ln = tl.where(act, e >> 8, 0)
            bad = bad | (act & (ln == 0)).to(tl.int32)
            acc = acc >> ln.to(tl.uint64)
            nbits = nbits - ln
            used = used + ln
            if VEC == 4:
                packed = packed | (tl.where(act, e & 0xFF, 0).to(tl.uint32) << (8 * k))
            else:
                packed = packed | (tl.where(act, e & 0xFF, 0).to(tl.uint64) << (8 * k))
        if VEC == 4:
            tl.store(out_ptr + ob + i // VEC, packed.to(tl.int32, bitcast=True), mask=live & (i < n))
        else:
            tl.store(out_ptr + ob + i // VEC, packed.to(tl.int64, bitcast=True), mask=live & (i < n))
    bad = bad | (used > nw * 32).to(tl.int32) | (((used + 31) >> 5) != nw).to(tl.int32)
    bad = bad | (acc != 0).to(tl.int32)  # what is left is the last word's padding (and zeros past it)
    bad = tl.where(live, bad, 0)
    tl.atomic_max(err_ptr, tl.max(bad, axis=0))
# fmt: on


#: launch settings (lanes a program, warps, bytes a load/store, load ahead): the fastest of the sweep in
#: benchmarks/huffman_gpu.py on an H200 (Triton 3.6; every setting swept was within ~10% of the best)
ENCODE_CFG = {"lanes": 128, "warps": 4, "vec": 8, "prefetch": 1}
DECODE_CFG = {"lanes": 64, "warps": 2, "vec": 8, "prefetch": 1}
HIST_CFG = {"kind": "histogram", "warps": 4}
_VIEW = {4: torch.int32, 8: torch.int64}


def block_hist(src: torch.Tensor, blk_src: torch.Tensor, blk_n: torch.Tensor, **cfg: Any) -> torch.Tensor:
    """int32 ``[blocks, 256]``: the byte histogram of each block (``blk_src``: byte offsets from ``src``, each
    a multiple of 8 from a 16-byte aligned address). ``kind`` ``"histogram"`` (``tl.histogram``) or
    ``"onehot"`` (tensor cores); a Triton that cannot build the first falls back to the second for good."""
    c = {**HIST_CFG, **cfg}
    nb = blk_n.numel()
    hist = torch.empty((nb, 256), dtype=torch.int32, device=src.device)
    if nb:
        if c["kind"] == "histogram":
            try:
                _block_hist_kernel[(nb,)](src, blk_src, blk_n, hist, BLOCK=BLOCK, num_warps=c["warps"])
                return hist
            except Exception:  # noqa: BLE001 - tl.histogram missing or not lowered here: the tensor-core kernel
                if cfg.get("kind") == "histogram":
                    raise
                HIST_CFG["kind"] = "onehot"
        _block_hist_onehot_kernel[(nb,)](src, blk_src, blk_n, hist, BLOCK=BLOCK, K=256, num_warps=4)
    return hist


def block_bits(hist: torch.Tensor, blk_tab: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int32 ``[blocks]``: coded bits of each block (``lengths`` int32 ``[streams * 256]``, ``blk_tab`` the
    offset of each block's stream in it)."""
    nb = blk_tab.numel()
    bits = torch.empty(nb, dtype=torch.int32, device=hist.device)
    if nb:
        _block_bits_kernel[(triton.cdiv(nb, 16),)](hist, blk_tab, lengths, bits, nb, ROWS=16, num_warps=4)
    return bits


def encode(
    src: torch.Tensor,
    blk_src: torch.Tensor,
    blk_n: torch.Tensor,
    blk_tab: torch.Tensor,
    etab: torch.Tensor,
    blk_wo: torch.Tensor,
    out: torch.Tensor,
    **cfg: int,
) -> None:
    """Write every block's words from its first word ``blk_wo`` on, into ``out`` (int32).

    ``src`` uint8: ``blk_src`` are byte offsets from its first byte (negative or past its end too: the
    streams of one batch may live in separate allocations), each a multiple of 8 from a 16-byte aligned
    address; a load may read up to 7 bytes past a block's end (never past a 16-byte aligned allocation's
    rounded end). ``etab`` int16 ``[streams * 256]``: code | (length - 1) << 12 of each present byte."""
    _launch(_encode_kernel, {**ENCODE_CFG, **cfg}, blk_n.numel(), src, blk_src, blk_n, blk_tab, etab, blk_wo, out)


def decode(
    words: torch.Tensor,
    blk_wo: torch.Tensor,
    blk_nw: torch.Tensor,
    blk_n: torch.Tensor,
    blk_tab: torch.Tensor,
    blk_out: torch.Tensor,
    dtab: torch.Tensor,
    out: torch.Tensor,
    err: torch.Tensor,
    **cfg: int,
) -> None:
    """Decode every block into ``out`` (uint8, a multiple of 16 bytes, each block at a 16-byte aligned
    offset ``blk_out``; a short block's last store may write up to 7 bytes past it). ``dtab`` int16
    ``[streams * 4096]``: symbol | length << 8, 0 for a hole. ``err[0]`` becomes 1 when a block is corrupt."""
    c = {**DECODE_CFG, **cfg}
    args = (words, blk_wo, blk_nw, blk_n, blk_tab, blk_out, dtab, out.view(_VIEW[c["vec"]]), err)
    _launch(_decode_kernel, c, blk_n.numel(), *args, TABLE=4096)


def _launch(kernel: Any, c: dict[str, int], nb: int, *args: Any, **meta: Any) -> None:
    """Run a block coder ``kernel`` over ``nb`` blocks, ``c["lanes"]`` blocks a program."""
    if nb:
        kernel[(triton.cdiv(nb, c["lanes"]),)](
            *args, nb, BLOCK=BLOCK, LANES=c["lanes"], VEC=c["vec"], PREFETCH=bool(c["prefetch"]),
            num_warps=c["warps"], **meta,
        )  # fmt: skip


__all__ = ["block_hist", "block_bits", "encode", "decode", "ENCODE_CFG", "DECODE_CFG", "HIST_CFG"]
