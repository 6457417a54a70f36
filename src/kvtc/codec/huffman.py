"""Fast GPU entropy coding that any CPU decodes: canonical Huffman over bytes in independent 4 KiB blocks.

Backend ``huff4k``. One code table per stream (built from the stream's byte histogram), then the stream is
cut into blocks of :data:`BLOCK` bytes (the last one shorter), each coded on its own from a 32-bit word
boundary, so a GPU codes or decodes every block in parallel. Layout (docs/FORMAT.md, "Entropy backend
huff4k")::

    u8[128]   code lengths of byte values 0..255, 4 bits each: byte i holds symbol 2i in its low nibble,
              2i+1 in its high nibble; 0 = symbol absent; at most MAX_LEN = 12
    u32 LE    block count c = ceil(raw_len / BLOCK) (0 for an empty stream)
    u16 LE    x c: coded 32-bit words of each block (each <= BLOCK * MAX_LEN / 32 = 1536)
    u32 LE    the words of all blocks back to back

Bits are written LSB-first into little-endian 32-bit words; a block's last word is padded with zero bits.
Codes are canonical (DEFLATE-style: assigned in order of (length, symbol)) and stored bit-reversed, so a
decoder peeks the next 12 bits LSB-first and looks them up in a 4096-entry table of (symbol, length). The
code lengths come from :func:`code_lengths`, a deterministic length-limited Huffman construction (package-
merge) over the byte histogram; the CPU encoder and the GPU encoder call the same function on the same
histogram, so both write byte-identical streams.

Decoding validates everything it can before it allocates (header present, block count, word counts, their
sum against the stream length, Kraft's equality of the lengths, each block's word count within what its
byte count can code to) and then that every block decodes to exactly its byte count, hitting no table hole,
consuming exactly its words (``ceil(bits / 32) == words``) and leaving only zero padding bits. Any failure
raises :class:`kvtc.errors.FormatError`.

On the GPU (:meth:`DeviceCoder.encode_device`): a per-block byte histogram kernel over all streams, the
per-stream sums read back (one small sync), :func:`code_lengths_batch` and the tables on the host, each
block's bits from its histogram, the word counts read back (a second small sync) and their exclusive
cumulative sum, then one encode launch for every block of every stream. Decoding parses and validates every
header on the host, copies the words through pinned memory and decodes every block in one launch.

The CPU twin (:func:`cpu_compress`, :func:`cpu_decompress`) is vectorized numpy and is always registered in
:data:`kvtc.codec.entropy.BACKENDS`. The GPU coder (:class:`DeviceCoder`, Triton kernels in
:mod:`kvtc.kernels.triton_huffman`) exists where CUDA and Triton are available (:func:`device_coder`).
torch and Triton are imported lazily: this module imports on a CPU-only machine without either.
"""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FormatError

if TYPE_CHECKING:  # pragma: no cover
    import torch

NAME = "huff4k"
#: raw bytes per independently coded block
BLOCK = 4096
#: longest code, in bits (the decoder's table has 2**MAX_LEN entries)
MAX_LEN = 12
#: most 32-bit words one block may code to (every byte at MAX_LEN bits)
MAX_BLOCK_WORDS = BLOCK * MAX_LEN // 32
#: bytes before the word-count table: the nibble-packed lengths and the block count
HEAD = 128 + 4
_TABLE = 1 << MAX_LEN
_U32 = struct.Struct("<I")


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


def _check_lengths(lengths: np.ndarray) -> None:
    """Kraft: sum 2^-L == 1 (<= 1 when exactly one symbol is present)."""
    present = lengths[lengths > 0].astype(np.int64)
    if len(present) == 0:
        return
    kraft = int((np.int64(1) << (MAX_LEN - present)).sum())
    if kraft > _TABLE or (len(present) > 1 and kraft != _TABLE):
        raise FormatError(f"{NAME} code lengths are not a complete prefix code (Kraft sum {kraft}/{_TABLE})")


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
    rev = _REV12[codes & (_TABLE - 1)] >> (MAX_LEN - ln).clip(min=0)  # the code's bits, first bit lowest
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
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = canonical_codes(lengths)
    table = np.zeros(_TABLE, dtype=np.int32)
    for s in np.flatnonzero(lengths):
        ln = int(lengths[s])
        table[int(codes[s]) :: 1 << ln] = s | (ln << 8)
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


def _frame(lengths: np.ndarray, words_per_block: np.ndarray, words: bytes | memoryview | np.ndarray) -> bytes:
    counts = np.asarray(words_per_block, dtype="<u2")
    return b"".join([pack_lengths(lengths), _U32.pack(len(counts)), counts.tobytes(), memoryview(words)])


# ------------------------------------------------------------------------------------------ stream parsing
class _Parsed:
    __slots__ = ("lengths", "words", "head", "raw_len")

    def __init__(self, lengths: np.ndarray, words: np.ndarray, head: int, raw_len: int):
        self.lengths = lengths  # uint8 [256]
        self.words = words  # int64 [c]: coded words of each block
        self.head = head  # byte offset of the first word
        self.raw_len = raw_len


def _block_sizes(raw_len: int) -> np.ndarray:
    c = -(-raw_len // BLOCK)
    n = np.full(c, BLOCK, dtype=np.int64)
    if c:
        n[-1] = raw_len - (c - 1) * BLOCK
    return n


def parse(data: bytes | bytearray | memoryview, raw_len: int) -> _Parsed:
    """Validate a ``huff4k`` stream's header against ``raw_len``; allocates nothing larger than the header."""
    mv = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    if raw_len < 0:
        raise FormatError(f"{NAME}: negative raw length {raw_len}")
    if len(mv) < HEAD:
        raise FormatError(f"{NAME} stream of {len(mv)} bytes is shorter than its {HEAD}-byte header")
    lengths = unpack_lengths(mv[:128])
    if int(lengths.max()) > MAX_LEN:
        raise FormatError(f"{NAME} code length {int(lengths.max())} exceeds {MAX_LEN}")
    (c,) = _U32.unpack_from(mv, 128)
    count = -(-raw_len // BLOCK)
    if c != count:
        raise FormatError(f"{NAME} stream has {c} blocks, {count} expected for {raw_len} bytes")
    head = HEAD + 2 * c
    if len(mv) < head:
        raise FormatError(f"{NAME} stream ends inside its word-count table")
    words = np.frombuffer(mv[HEAD:head], dtype="<u2").astype(np.int64)
    if c and int(words.max()) > MAX_BLOCK_WORDS:
        raise FormatError(f"{NAME} block declares {int(words.max())} words, at most {MAX_BLOCK_WORDS} possible")
    if 4 * int(words.sum()) != len(mv) - head:
        raise FormatError(f"{NAME} word counts ({4 * int(words.sum())} bytes) do not match the "
                          f"{len(mv) - head} bytes after the header")
    _check_lengths(lengths)
    if c:
        present = lengths[lengths > 0]
        if len(present) == 0:
            raise FormatError(f"{NAME} stream of {raw_len} bytes has no symbols")
        n = _block_sizes(raw_len)
        lo = (n * int(present.min()) + 31) >> 5
        hi = (n * int(present.max()) + 31) >> 5
        if ((words < lo) | (words > hi)).any():
            raise FormatError(f"{NAME} block word counts are outside what their byte counts can code to")
    return _Parsed(lengths, words, head, raw_len)


# ------------------------------------------------------------------------------------------------ CPU twin
_M32 = np.uint64(0xFFFFFFFF)
_CHUNK_PAIRS = 1 << 17  # byte pairs per encoder chunk (256 KiB of input: stays in cache)
_ROW = BLOCK // 2  # byte pairs per block


def _pair_tables(lengths: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Length (uint8) and code (uint64) of every little-endian byte pair: first byte's code in the low bits."""
    lo = np.arange(65536) & 255
    hi = np.arange(65536) >> 8
    ln = lengths.astype(np.uint64)
    c = codes.astype(np.uint64)
    return (lengths[lo] + lengths[hi]).astype(np.uint8), c[lo] | (c[hi] << ln[lo])


def _encode_pairs(pairs: np.ndarray, l16: np.ndarray, c16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(words of each block, the blocks' words back to back) of whole blocks given as byte pairs."""
    ln = np.take(l16, pairs).reshape(-1, _ROW)
    cs = np.cumsum(ln, axis=1, dtype=np.uint16)  # <= 2048 * 24 bits: fits
    words = (cs[:, -1].astype(np.int64) + 31) >> 5
    wo = np.zeros(len(words), dtype=np.int64)
    np.cumsum(words[:-1], out=wo[1:])
    cs -= ln  # exclusive: each pair's first bit in its block
    wl = (cs >> 5).reshape(-1)
    v = np.take(c16, pairs)
    v <<= (cs & 31).reshape(-1).astype(np.uint64)
    # a pair's code spans at most 2 words; the codes starting in one word have disjoint bits, so their sum
    # is their OR. Sum each run of equal word index with a (wrapping, still exact) cumulative sum.
    cv = np.cumsum(v)
    ends = np.flatnonzero(wl[1:] != wl[:-1])
    ends = np.append(ends, len(wl) - 1)
    sums = np.diff(cv[ends], prepend=np.uint64(0))
    total = int(wo[-1] + words[-1])
    acc = np.zeros(total + 1, dtype=np.uint64)
    acc[wl[ends].astype(np.int64) + wo[ends // _ROW]] = sums  # the tail's zero-length pads land at <= total
    out = (acc[:total] & _M32).astype(np.uint32)
    out[1:] |= (acc[: total - 1] >> np.uint64(32)).astype(np.uint32)
    return words, out


def byte_histogram(arr: np.ndarray) -> np.ndarray:
    """int64 ``[256]`` counts of each byte value (counted as byte pairs: numpy's bincount casts its input
    to intp, so fewer, cache-sized pieces are faster)."""
    h2 = np.zeros(65536, dtype=np.int64)
    pairs = arr[: len(arr) // 2 * 2].view("<u2")
    for i in range(0, len(pairs), 1 << 18):
        h2 += np.bincount(pairs[i : i + (1 << 18)], minlength=65536)
    sq = h2.reshape(256, 256)  # [second byte, first byte]
    h = sq.sum(axis=0) + sq.sum(axis=1)
    if len(arr) % 2:
        h[arr[-1]] += 1
    return h


def cpu_compress(data: bytes | bytearray | memoryview) -> bytes:
    """Code ``data`` as one ``huff4k`` stream (vectorized numpy; byte-identical to the GPU coder)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    n = len(arr)
    lengths = code_lengths(byte_histogram(arr))
    if n == 0:
        return _frame(lengths, np.zeros(0, np.int64), b"")
    codes = canonical_codes(lengths)
    l16, c16 = _pair_tables(lengths, codes)
    nb = -(-n // BLOCK)
    full = n // BLOCK
    words_all, out_all = [], []
    body = arr[: full * BLOCK].view("<u2")
    for i in range(0, len(body), _CHUNK_PAIRS):
        w, o = _encode_pairs(body[i : i + _CHUNK_PAIRS], l16, c16)
        words_all.append(w)
        out_all.append(o)
    if nb > full:  # the short last block: pad to a whole block with pairs of length 0
        tail = arr[full * BLOCK :]
        pairs = np.zeros(_ROW, dtype=np.uint16)
        pl = np.zeros(_ROW, dtype=np.uint8)
        pc = np.zeros(_ROW, dtype=np.uint64)
        k = len(tail) // 2
        pairs[:k] = tail[: 2 * k].view("<u2")
        pl[:k] = l16[pairs[:k]]
        pc[:k] = c16[pairs[:k]]
        if len(tail) % 2:
            pl[k] = lengths[tail[-1]]
            pc[k] = codes[tail[-1]]
        idx = np.arange(_ROW, dtype=np.uint16)
        w, o = _encode_pairs(idx, pl, pc)  # a pair table indexed by position: the same packing code
        words_all.append(w)
        out_all.append(o)
    words = np.concatenate(words_all)
    return _frame(lengths, words, np.concatenate(out_all).astype("<u4"))


_DEC_GROUP = 4096  # blocks decoded together (16 MiB of output)
_HOLE = np.uint32(0xFFFFFF00)  # a table hole: symbol 0, length 2**24 - 1, so the block overruns


#: streams of fewer blocks are decoded one symbol at a time (~1 ms a block, against ~35 ms of fixed cost
#: for the numpy lockstep, which is faster from about 40 blocks on)
_PY_BLOCKS = 32


def _decode_blocks_py(payload: np.ndarray, wstart: np.ndarray, words: np.ndarray, nbytes: np.ndarray,
                      table: np.ndarray, out: np.ndarray) -> None:
    """The scalar decoder of a few blocks: the same acceptance rules as the lockstep one."""
    tab = table.tolist()
    mask = _TABLE - 1
    for b in range(len(words)):
        cnt, n = int(words[b]), int(nbytes[b])
        ws = payload[wstart[b] : wstart[b] + cnt].tolist()
        res = bytearray(n)
        acc = nbits = rd = used = 0
        for i in range(n):
            if nbits < MAX_LEN:
                acc |= (ws[rd] if rd < cnt else 0) << nbits  # past the block's words: zeros
                nbits += 32
                rd += 1
            e = tab[acc & mask]
            ln = e >> 8
            if not ln:
                raise FormatError(f"{NAME}: a code not in the table (corrupt stream)")
            res[i] = e & 0xFF
            acc >>= ln
            nbits -= ln
            used += ln
        if used > 32 * cnt or (used + 31) >> 5 != cnt:
            raise FormatError(f"{NAME}: a block does not decode to its byte count within exactly its words "
                              "(corrupt stream)")
        if acc:  # what is left is the last word's padding (and zero words past it)
            raise FormatError(f"{NAME}: nonzero padding after a block's last code (corrupt stream)")
        out[b * BLOCK : b * BLOCK + n] = np.frombuffer(res, dtype=np.uint8)


def cpu_decompress(data: bytes | bytearray | memoryview, raw_len: int) -> bytes:
    """Decode a ``huff4k`` stream of exactly ``raw_len`` bytes (numpy, all blocks in lockstep; a stream of a
    few blocks symbol by symbol)."""
    p = parse(data, raw_len)
    if raw_len == 0:
        return b""
    payload = np.frombuffer(memoryview(data).cast("B")[p.head :], dtype="<u4")
    nbytes = _block_sizes(raw_len)
    wstart = np.zeros(len(p.words) + 1, dtype=np.int64)
    np.cumsum(p.words, out=wstart[1:])
    out = np.empty(raw_len, dtype=np.uint8)
    if len(p.words) < _PY_BLOCKS:
        _decode_blocks_py(payload, wstart, p.words, nbytes, decode_table(p.lengths), out)
        return out.tobytes()
    table = decode_table(p.lengths).astype(np.uint32)
    table[table == 0] = _HOLE
    for g0 in range(0, len(p.words), _DEC_GROUP):
        g1 = min(g0 + _DEC_GROUP, len(p.words))
        cnt = p.words[g0:g1]
        nb = g1 - g0
        # the group's words with one zero word after each block, as overlapping 64-bit pairs
        seg = payload[wstart[g0] : wstart[g1]]
        padded = np.zeros(len(seg) + nb + 1, dtype=np.uint64)
        starts = np.zeros(nb, dtype=np.int64)
        np.cumsum(cnt[:-1] + 1, out=starts[1:])
        padded[np.arange(len(seg)) + np.repeat(np.arange(nb), cnt)] = seg
        pairs = padded[:-1] | (padded[1:] << np.uint64(32))
        pos = (starts * 32).astype(np.uint64)  # bit position, in the padded group
        first = pos.copy()
        lim = ((starts + cnt) * 32).astype(np.uint64)  # the block's zero word: reading stops there
        steps = int(nbytes[g0:g1].max())  # BLOCK unless the group is one short block
        sym = np.empty((steps, nb), dtype=np.uint8)
        tail_n = int(nbytes[g1 - 1])
        tail_pos = None
        g = np.empty(nb, dtype=np.uint64)
        x = np.empty(nb, dtype=np.uint64)
        e = np.empty(nb, dtype=np.uint32)
        for i in range(steps):
            if i == tail_n:  # the short last block is done: keep its position
                tail_pos = pos[-1]
            np.minimum(pos, lim, out=g)
            np.take(pairs, g >> np.uint64(5), out=x)
            x >>= g & np.uint64(31)
            x &= np.uint64(_TABLE - 1)
            np.take(table, x, out=e)
            sym[i] = e
            pos += e >> np.uint32(8)
        if tail_pos is not None:
            pos[-1] = tail_pos
        used = (pos - first).astype(np.int64)
        if ((used > cnt * 32) | (((used + 31) >> 5) != cnt)).any():
            raise FormatError(f"{NAME}: a block does not decode to its byte count within exactly its words "
                              "(corrupt stream)")
        last = payload[wstart[g0 + 1 : g1 + 1] - 1].astype(np.uint64)  # every block has >= 1 word
        rem = used % 32  # bits used of the last word (0: all of it)
        if np.where(rem > 0, last >> rem.astype(np.uint64), 0).any():
            raise FormatError(f"{NAME}: nonzero padding after a block's last code (corrupt stream)")
        blk = sym.T  # [blocks, steps]; every block but the group's last is whole (steps == BLOCK)
        o0 = g0 * BLOCK
        out[o0 : o0 + (nb - 1) * BLOCK] = blk[:-1].reshape(-1)
        out[o0 + (nb - 1) * BLOCK : o0 + (nb - 1) * BLOCK + tail_n] = blk[-1, :tail_n]
    return out.tobytes()


# ----------------------------------------------------------------------------------------------- GPU coder
_COPY_WORDS = 1 << 22  # words a staging copy job moves (16 MiB)


def _align(n: int, a: int = 16) -> int:
    return -(-n // a) * a


class DeviceCoder:
    """Batched ``huff4k`` coding of uint8 device tensors with the Triton kernels (one launch per batch)."""

    def __init__(self, device: Any):
        import torch

        from concurrent.futures import ThreadPoolExecutor

        from ..kernels import triton_huffman

        self.torch = torch
        self.k = triton_huffman
        self.device = torch.device(device)
        #: pinned staging and synchronization on CUDA; a CPU device runs the kernels under TRITON_INTERPRET=1
        self.cuda = self.device.type == "cuda"
        self.pool = ThreadPoolExecutor(8)
        #: seconds of the last call's steps (for benchmarks)
        self.last: dict[str, float] = {}

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    # ---- encode
    def _sources(self, flat: list[torch.Tensor]) -> tuple[torch.Tensor, list[int], list[Any]]:
        """One uint8 base tensor and each stream's byte offset from it. Streams on 16-byte aligned addresses
        are read where they lie (the kernels take offsets across allocations: no copy); others are copied
        into one aligned scratch buffer. Returns the tensors to keep alive while the kernels run."""
        torch = self.torch
        ok = [t.numel() == 0 or (t.device == self.device and t.data_ptr() % 16 == 0) for t in flat]
        scratch = None
        pos, spos = [], 0
        for t, good in zip(flat, ok):
            pos.append(spos)
            if not good:
                spos += _align(t.numel())
        if spos:
            scratch = torch.empty(spos, dtype=torch.uint8, device=self.device)
            for t, good, p in zip(flat, ok, pos):
                if not good:
                    scratch[p : p + t.numel()].copy_(t)
        cands = [t for t, good in zip(flat, ok) if good and t.numel()]
        base = cands[0] if cands else scratch
        if base is None:
            return torch.zeros(16, dtype=torch.uint8, device=self.device), [0] * len(flat), []
        b0 = base.data_ptr()
        starts = [(t.data_ptr() - b0 if good else scratch.data_ptr() + p - b0) if t.numel() else 0
                  for t, good, p in zip(flat, ok, pos)]
        return base, starts, [scratch, *flat]

    def encode_device(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """Code every stream on the device; returns the host-side tables and the device words (no D2H of
        the payload): ``lengths`` [S, 256] uint8, ``words`` (numpy int64 per block), ``spans`` (first,
        end block of each stream), ``out`` (int32 device words, all streams back to back), ``wstart``
        (first word of each stream).

        Steps: per-block byte histograms (one kernel over all streams) summed per stream and read back
        (sync 1); code lengths and tables on the host (:func:`code_lengths`, the CPU encoder's function);
        each block's bits = its histogram times the lengths, word counts read back (sync 2) and their
        exclusive cumulative sum; then the encode kernel writes every block at its first word."""
        torch = self.torch
        dev = self.device
        t0 = time.perf_counter()
        flat = [t.contiguous().view(torch.uint8).reshape(-1) for t in tensors]
        sizes = [t.numel() for t in flat]
        nblk = [-(-n // BLOCK) for n in sizes]
        spans, nb = [], 0
        for c in nblk:
            spans.append((nb, nb + c))
            nb += c
        if nb == 0:
            lengths = np.zeros((len(flat), 256), dtype=np.uint8)
            return {"lengths": lengths, "words": np.zeros(0, np.int64), "spans": spans,
                    "out": torch.zeros(0, dtype=torch.int32, device=dev), "wstart": [0] * len(flat)}
        base, starts, keep = self._sources(flat)
        # per-block arrays, built on the device from per-stream numbers: byte offset from base, byte count
        per = torch.tensor([starts, sizes, [a for a, _ in spans], nblk], dtype=torch.int64).to(dev, non_blocking=True)
        sid = torch.repeat_interleave(torch.arange(len(flat), device=dev), per[3], output_size=nb)
        local = torch.arange(nb, device=dev) - per[2][sid]
        d_src = per[0][sid] + BLOCK * local
        d_n = torch.clamp(per[1][sid] - BLOCK * local, max=BLOCK).to(torch.int32)
        d_tab = (sid * 256).to(torch.int32)
        bh = self.k.block_hist(base, d_src, d_n)  # [blocks, 256] int32
        zero = torch.zeros(256, dtype=torch.int64, device=dev)
        hist = torch.stack([bh[a:b].sum(0, dtype=torch.int64) if b > a else zero for a, b in spans])
        hist_h = hist.cpu().numpy()  # sync 1: the histograms
        t1 = time.perf_counter()
        lengths = code_lengths_batch(hist_h)
        etab = encode_tables(lengths).reshape(-1)
        t2 = time.perf_counter()
        d_len = torch.from_numpy(lengths.astype(np.int32).reshape(-1)).to(dev, non_blocking=True)
        d_etab = torch.from_numpy(etab).to(dev, non_blocking=True)
        bits = self.k.block_bits(bh, d_tab, d_len)
        words = (bits + 31) >> 5
        wo = torch.cumsum(words.to(torch.int64), 0)
        words_h = words.cpu().numpy().astype(np.int64)  # sync 2: the word counts
        total = int(words_h.sum())
        t3 = time.perf_counter()
        out = torch.empty(max(total, 1), dtype=torch.int32, device=dev)
        self.k.encode(base, d_src, d_n, d_tab, d_etab, wo - words.to(torch.int64), out)
        csum = np.concatenate(([0], np.cumsum(words_h)))
        wstart = [int(csum[a]) for a, _ in spans]
        self._sync()
        del keep
        t4 = time.perf_counter()
        self.last = {"hist_s": t1 - t0, "tables_s": t2 - t1, "bits_s": t3 - t2, "encode_s": t4 - t3}
        return {"lengths": lengths, "words": words_h, "spans": spans, "out": out, "wstart": wstart}

    def compress(self, tensors: list[torch.Tensor]) -> list[bytes]:
        """Code each uint8 device tensor; returns one ``huff4k`` stream per tensor (what cpu_compress writes)."""
        return [bytes(p) for p in self.compress_parts(tensors)]

    def compress_parts(self, tensors: list[torch.Tensor]) -> list[Any]:
        """:meth:`compress` with each stream as :class:`~kvtc.codec.entropy.Parts`: its header bytes and its
        words as a view of one pinned host buffer (the container joins them: no per-stream copy)."""
        from .entropy import Parts

        torch = self.torch
        enc = self.encode_device(tensors)
        t0 = time.perf_counter()
        total = int(enc["words"].sum())
        host = torch.empty(max(total, 1), dtype=torch.int32, pin_memory=self.cuda)
        if total:
            host.copy_(enc["out"][:total])
        h = host.numpy().view("<u4")
        t1 = time.perf_counter()
        out = []
        for i, (a, b) in enumerate(enc["spans"]):
            ws = enc["wstart"][i]
            cnt = enc["words"][a:b]
            counts = np.asarray(cnt, dtype="<u2")
            head = b"".join([pack_lengths(enc["lengths"][i]), _U32.pack(len(counts)), counts.tobytes()])
            out.append(Parts([head, h[ws : ws + int(cnt.sum())]]))
        self.last = {**self.last, "d2h_s": t1 - t0, "frame_s": time.perf_counter() - t1}
        return out

    # ---- decode
    def stage(self, streams: list[bytes | memoryview], raw_lens: list[int],
              pinned: tuple[Any, list[int]] | None = None) -> dict[str, Any]:
        """Validate the streams' headers and copy their words to the device (through pinned memory).

        ``pinned``: ``(tensor, offsets)`` when the streams lie in a pinned uint8 host tensor at those byte
        offsets: their span goes to the device in one copy and each stream's words are then aligned there
        (no host staging)."""
        torch = self.torch
        dev = self.device
        t0 = time.perf_counter()
        parsed = [parse(s, n) for s, n in zip(streams, raw_lens)]
        nwords = [int(p.words.sum()) for p in parsed]
        wbase, w = [], 0
        for k in nwords:
            wbase.append(w)
            w += k
        obase, out_bytes = [], 0
        for n in raw_lens:  # every stream's output starts 16-byte aligned (the kernel stores 8 bytes at a time)
            obase.append(out_bytes)
            out_bytes += _align(n)
        staging = d_words = None
        if pinned is not None:
            src_t, offs = pinned
            lo = min(offs) if offs else 0
            hi = max((o + len(memoryview(x)) for o, x in zip(offs, streams)), default=lo)
            d_raw = src_t[lo:hi].to(dev, non_blocking=True)
            d_words = torch.empty(max(w, 1), dtype=torch.int32, device=dev)
            d_bytes = d_words.view(torch.uint8)
            for o, p, wb, k in zip(offs, parsed, wbase, nwords):
                a = o - lo + p.head
                d_bytes[4 * wb : 4 * (wb + k)].copy_(d_raw[a : a + 4 * k])
        else:
            staging = torch.empty(max(w, 1), dtype=torch.int32, pin_memory=self.cuda)
            buf = staging.numpy()
            jobs = []
            for s, p, wb, k in zip(streams, parsed, wbase, nwords):
                src = np.frombuffer(memoryview(s).cast("B")[p.head :], dtype="<i4")
                for j in range(0, k, _COPY_WORDS):
                    jobs.append((buf[wb + j : wb + min(k, j + _COPY_WORDS)], src[j : j + _COPY_WORDS]))
            list(self.pool.map(lambda j: j[0].__setitem__(slice(None), j[1]), jobs))  # numpy copies drop the GIL
        dtab = np.concatenate([decode_table(p.lengths).astype(np.int16) for p in parsed] + [np.zeros(0, np.int16)])
        blk_wo = np.concatenate([wb + np.concatenate(([0], np.cumsum(p.words)[:-1])).astype(np.int64)
                                 for p, wb in zip(parsed, wbase) if len(p.words)] + [np.zeros(0, np.int64)])
        blk_nw = np.concatenate([p.words for p in parsed] + [np.zeros(0, np.int64)])
        blk_n = np.concatenate([_block_sizes(n) for n in raw_lens] + [np.zeros(0, np.int64)])
        blk_out = np.concatenate([ob + BLOCK * np.arange(len(p.words), dtype=np.int64)
                                  for p, ob in zip(parsed, obase)] + [np.zeros(0, np.int64)])
        blk_tab = np.concatenate([np.full(len(p.words), _TABLE * i, dtype=np.int64)
                                  for i, p in enumerate(parsed)] + [np.zeros(0, np.int64)])
        nb = len(blk_n)
        t1 = time.perf_counter()
        meta = torch.from_numpy(np.concatenate([blk_wo, blk_out, blk_nw, blk_n, blk_tab]))
        meta = meta.pin_memory() if self.cuda else meta
        d_meta = meta.to(dev, non_blocking=True)
        if d_words is None:
            d_words = staging.to(dev, non_blocking=True)
        d_tab = torch.from_numpy(dtab if len(dtab) else np.zeros(1, np.int16)).to(dev, non_blocking=True)
        self._sync()
        t2 = time.perf_counter()
        self.last = {"parse_stage_s": t1 - t0, "h2d_s": t2 - t1}
        return {"nb": nb, "words": d_words, "tab": d_tab, "raw_lens": list(raw_lens), "obase": obase,
                "out_bytes": out_bytes, "blk_wo": d_meta[:nb], "blk_out": d_meta[nb : 2 * nb],
                "blk_nw": d_meta[2 * nb : 3 * nb].to(torch.int32), "blk_n": d_meta[3 * nb : 4 * nb].to(torch.int32),
                "blk_tab": d_meta[4 * nb :].to(torch.int32)}

    def decode_device(self, st: dict[str, Any]) -> list[torch.Tensor]:
        """Decode staged streams on the device; raises FormatError when any block is corrupt."""
        torch = self.torch
        out = torch.empty(max(st["out_bytes"], 16), dtype=torch.uint8, device=self.device)
        if st["nb"]:
            err = torch.zeros(1, dtype=torch.int32, device=self.device)
            self.k.decode(st["words"], st["blk_wo"], st["blk_nw"], st["blk_n"], st["blk_tab"], st["blk_out"],
                          st["tab"], out, err)
            if int(err.item()):  # the one sync of a decode
                raise FormatError(f"{NAME}: a block is corrupt (a code not in the table, not exactly its byte "
                                  "count within exactly its words, or nonzero padding)")
        return [out[o : o + n] for o, n in zip(st["obase"], st["raw_lens"])]

    def decompress_pinned(self, pinned: torch.Tensor, offsets: list[int], coded_lens: list[int],
                          raw_lens: list[int]) -> list[torch.Tensor]:
        """:meth:`decompress` of streams lying in ``pinned`` (a pinned uint8 host tensor) at ``offsets``."""
        mv = memoryview(pinned.numpy())
        streams = [mv[o : o + n] for o, n in zip(offsets, coded_lens)]
        st = self.stage(streams, raw_lens, pinned=(pinned, list(offsets)))
        t0 = time.perf_counter()
        res = self.decode_device(st)
        self.last = {**self.last, "gpu_decode_s": time.perf_counter() - t0}
        return res

    def decompress(self, streams: list[bytes | memoryview], raw_lens: list[int]) -> list[torch.Tensor]:
        """Decode ``huff4k`` streams into uint8 device tensors of exactly ``raw_lens`` bytes."""
        st = self.stage(streams, raw_lens)
        t0 = time.perf_counter()
        res = self.decode_device(st)
        self.last = {**self.last, "gpu_decode_s": time.perf_counter() - t0}
        return res


_CODERS: dict[int, DeviceCoder] = {}


def device_coder(backend: str, device: Any) -> DeviceCoder | None:
    """The GPU coder of ``huff4k`` on ``device``, or None (another backend, no CUDA, or no Triton)."""
    if backend != NAME:
        return None
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken Triton: no GPU coder
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CODERS:
        _CODERS[idx] = DeviceCoder(torch.device("cuda", idx))
    return _CODERS[idx]


__all__ = ["NAME", "BLOCK", "MAX_LEN", "code_lengths", "code_lengths_batch", "canonical_codes", "encode_table",
           "encode_tables", "decode_table",
           "cpu_compress", "cpu_decompress", "parse", "DeviceCoder", "device_coder"]
