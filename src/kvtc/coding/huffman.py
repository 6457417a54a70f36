"""The ``huff4k`` entropy backend's stream format and its CPU coder: canonical Huffman over bytes in
independent 4 KiB blocks, which a GPU codes and decodes in parallel and any CPU decodes.

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

The CPU coder (:func:`cpu_compress`, :func:`cpu_decompress`) is vectorized numpy and is always registered in
:data:`kvtc.coding.entropy.BACKENDS`; the GPU coder is :mod:`kvtc.coding.huffman_gpu`. This module needs neither
torch nor Triton.
"""

from __future__ import annotations

import struct

import numpy as np

from ..errors import FormatError
from .huffman_codes import (  # noqa: F401  (the format's code tables, re-exported with it)
    MAX_LEN,
    NAME,
    TABLE,
    canonical_codes,
    canonical_codes_batch,
    check_lengths,
    code_lengths,
    code_lengths_batch,
    decode_table,
    encode_table,
    encode_tables,
    pack_lengths,
    unpack_lengths,
)

#: raw bytes per independently coded block
BLOCK = 4096
#: most 32-bit words one block may code to (every byte at MAX_LEN bits)
MAX_BLOCK_WORDS = BLOCK * MAX_LEN // 32
#: bytes before the word-count table: the nibble-packed lengths and the block count
HEAD = 128 + 4
_U32 = struct.Struct("<I")


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
        raise FormatError(
            f"{NAME} word counts ({4 * int(words.sum())} bytes) do not match the "
            f"{len(mv) - head} bytes after the header"
        )
    check_lengths(lengths)
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


def _decode_blocks_py(
    payload: np.ndarray, wstart: np.ndarray, words: np.ndarray, nbytes: np.ndarray, table: np.ndarray, out: np.ndarray
) -> None:
    """The scalar decoder of a few blocks: the same acceptance rules as the lockstep one."""
    tab = table.tolist()
    mask = TABLE - 1
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
            raise FormatError(
                f"{NAME}: a block does not decode to its byte count within exactly its words (corrupt stream)"
            )
        if acc:  # what is left is the last word's padding (and zero words past it)
            raise FormatError(f"{NAME}: nonzero padding after a block's last code (corrupt stream)")
        out[b * BLOCK : b * BLOCK + n] = np.frombuffer(res, dtype=np.uint8)


def cpu_decompress(data: bytes | bytearray | memoryview, raw_len: int) -> bytes:
    """Decode a ``huff4k`` stream of exactly ``raw_len`` bytes (numpy, all blocks in lockstep; a stream of a
    few blocks symbol by symbol)."""
    from .buffers import new_bytes  # (torch's module: imported only where a stream is decoded)

    p = parse(data, raw_len)
    if raw_len == 0:
        return b""
    payload = np.frombuffer(memoryview(data).cast("B")[p.head :], dtype="<u4")
    nbytes = _block_sizes(raw_len)
    wstart = np.zeros(len(p.words) + 1, dtype=np.int64)
    np.cumsum(p.words, out=wstart[1:])
    made = new_bytes(raw_len)  # the result is written in place: no copy of it into a bytes object
    result, out = made if made is not None else (None, np.empty(raw_len, dtype=np.uint8))
    if len(p.words) < _PY_BLOCKS:
        _decode_blocks_py(payload, wstart, p.words, nbytes, decode_table(p.lengths), out)
        return result if result is not None else out.tobytes()
    table = decode_table(p.lengths).astype(np.uint32)
    table[table == 0] = _HOLE
    for g0 in range(0, len(p.words), _DEC_GROUP):
        g1 = min(g0 + _DEC_GROUP, len(p.words))
        cnt = p.words[g0:g1]
        nb = g1 - g0
        # the group's words with one zero word after each block, as overlapping 64-bit pairs
        seg = payload[wstart[g0] : wstart[g1]]
        padded = np.empty(len(seg) + nb + 1, dtype=np.uint64)
        starts = np.zeros(nb, dtype=np.int64)
        np.cumsum(cnt[:-1] + 1, out=starts[1:])
        padded[:-1] = np.insert(seg, np.cumsum(cnt), 0)  # a zero word after each block's (every block has one)
        padded[-1] = 0
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
            x &= np.uint64(TABLE - 1)
            np.take(table, x, out=e)
            sym[i] = e
            pos += e >> np.uint32(8)
        if tail_pos is not None:
            pos[-1] = tail_pos
        used = (pos - first).astype(np.int64)
        if ((used > cnt * 32) | (((used + 31) >> 5) != cnt)).any():
            raise FormatError(
                f"{NAME}: a block does not decode to its byte count within exactly its words (corrupt stream)"
            )
        last = payload[wstart[g0 + 1 : g1 + 1] - 1].astype(np.uint64)  # every block has >= 1 word
        rem = used % 32  # bits used of the last word (0: all of it)
        if np.where(rem > 0, last >> rem.astype(np.uint64), 0).any():
            raise FormatError(f"{NAME}: nonzero padding after a block's last code (corrupt stream)")
        blk = sym.T  # [blocks, steps]; every block but the group's last is whole (steps == BLOCK)
        o0 = g0 * BLOCK
        out[o0 : o0 + (nb - 1) * BLOCK] = blk[:-1].reshape(-1)
        out[o0 + (nb - 1) * BLOCK : o0 + (nb - 1) * BLOCK + tail_n] = blk[-1, :tail_n]
    return result if result is not None else out.tobytes()


__all__ = [
    "NAME",
    "BLOCK",
    "HEAD",
    "MAX_LEN",
    "byte_histogram",
    "canonical_codes",
    "canonical_codes_batch",
    "code_lengths",
    "code_lengths_batch",
    "cpu_compress",
    "cpu_decompress",
    "decode_table",
    "encode_table",
    "encode_tables",
    "pack_lengths",
    "parse",
    "unpack_lengths",
]
