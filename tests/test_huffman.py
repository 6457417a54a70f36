"""The ``huff4k`` entropy backend's CPU twin: format, round trips, code lengths, compression, hostile input.

The GPU coder must write byte-identical streams (tests/test_gpu_huffman.py); here the vectorized numpy
encoder is checked against a plain per-byte bit writer, and a golden stream pins the format byte for byte.
"""

from __future__ import annotations

import heapq
import struct
import tracemalloc

import numpy as np
import pytest

from kvtc.coding import huffman as H
from kvtc.coding.entropy import BACKENDS, decode_stream, device_coder, encode_stream
from kvtc.errors import FormatError


# ------------------------------------------------------------------------------------------------ helpers
def packed_int2(n_bytes: int, seed: int = 0, p=(0.05, 0.45, 0.45, 0.05)) -> bytes:
    """Bytes of bit-packed int2 symbols (4 a byte, low bits first) drawn i.i.d. with probabilities ``p``."""
    s = np.random.default_rng(seed).choice(4, size=(n_bytes, 4), p=p).astype(np.uint8)
    return (s[:, 0] | s[:, 1] << 2 | s[:, 2] << 4 | s[:, 3] << 6).astype(np.uint8).tobytes()


def packed_int4(n_bytes: int, seed: int = 0, sigma: float = 2.0) -> bytes:
    """Bytes of two int4 nibbles, each a discretized Gaussian around the middle of 0..15."""
    x = np.random.default_rng(seed).normal(7.5, sigma, size=(n_bytes, 2))
    q = np.clip(np.round(x), 0, 15).astype(np.uint8)
    return (q[:, 0] | q[:, 1] << 4).astype(np.uint8).tobytes()


def entropy_bytes(data: bytes) -> float:
    """Order-0 entropy bound of ``data`` in bytes."""
    h = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
    p = h[h > 0] / len(data)
    return float(-(p * np.log2(p)).sum() * len(data) / 8)


def reference_encode(data: bytes) -> bytes:
    """The format written the slow, obvious way: one byte at a time into a Python int per block."""
    arr = np.frombuffer(data, dtype=np.uint8)
    lengths = H.code_lengths(np.bincount(arr, minlength=256))
    codes = H.canonical_codes(lengths)
    counts, words = [], []
    for b0 in range(0, len(data), H.BLOCK):
        acc = nbits = 0
        for byte in data[b0 : b0 + H.BLOCK]:
            acc |= int(codes[byte]) << nbits
            nbits += int(lengths[byte])
        nw = (nbits + 31) // 32
        counts.append(nw)
        words += [(acc >> (32 * k)) & 0xFFFFFFFF for k in range(nw)]
    nib = bytes(int(lengths[2 * i]) | int(lengths[2 * i + 1]) << 4 for i in range(128))
    return (
        nib
        + struct.pack("<I", len(counts))
        + struct.pack(f"<{len(counts)}H", *counts)
        + struct.pack(f"<{len(words)}I", *words)
    )


def huffman_cost(hist: np.ndarray) -> int:
    """Total coded bits of an unconstrained Huffman code (the optimum without a length limit)."""
    h = [int(x) for x in hist if x]
    if len(h) < 2:
        return sum(h)
    heapq.heapify(h)
    cost = 0
    while len(h) > 1:
        a, b = heapq.heappop(h), heapq.heappop(h)
        cost += a + b
        heapq.heappush(h, a + b)
    return cost


def kraft(lengths: np.ndarray) -> float:
    return float(sum(2.0 ** -int(x) for x in lengths if x))


rng = np.random.default_rng(1234)
CASES = {
    "empty": b"",
    "one byte": b"\x2a",
    "aab": b"aab",
    "one value": b"\x07" * 5000,
    "one value, 2 blocks": b"\xff" * 8192,
    "all 256 values": bytes(range(256)) * 41,
    "uniform random": rng.integers(0, 256, 3 * 4096 + 17, dtype=np.uint8).tobytes(),
    "int2 packed": packed_int2(2 * 4096 + 999, seed=1),
    "int4 gaussian": packed_int4(4096 + 1, seed=2),
    "sparse skewed": rng.choice(256, 7000, p=rng.dirichlet(np.full(256, 0.05))).astype(np.uint8).tobytes(),
    "exact block": packed_int2(4096, seed=3),
    "odd tail": packed_int2(4096 + 3, seed=4),
    "two values": bytes(rng.integers(0, 2, 5000, dtype=np.uint8) * 200),
}


PATHS = {"scalar": 1 << 30, "lockstep": 0}  # H._PY_BLOCKS: every stream decoded by one path or the other


def decode_both(enc: bytes, raw_len: int, monkeypatch) -> bytes | None:
    """Decode with the scalar and the lockstep decoder: both refuse, or both give the same bytes."""
    got = []
    for limit in PATHS.values():
        monkeypatch.setattr(H, "_PY_BLOCKS", limit)
        try:
            got.append(H.cpu_decompress(enc, raw_len))
        except FormatError:
            got.append(None)
    assert got[0] == got[1]
    return got[0]


# ----------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_and_reference_bits(name, monkeypatch):
    data = CASES[name]
    enc = H.cpu_compress(data)
    assert enc == reference_encode(data)
    assert decode_both(enc, len(data), monkeypatch) == data
    p = H.parse(enc, len(data))
    assert p.lengths.max() <= H.MAX_LEN
    assert len(p.words) == -(-len(data) // H.BLOCK) and (p.words <= H.MAX_BLOCK_WORDS).all()
    present = int((p.lengths > 0).sum())
    if present > 1:
        assert kraft(p.lengths) == 1.0
    elif present == 1:
        assert p.lengths.max() == 1


def test_registered_backend_round_trip():
    data = packed_int2(10_000, seed=5)
    name, coded = encode_stream(data, H.NAME)
    assert name == H.NAME and len(coded) < len(data)
    assert BACKENDS[H.NAME].decompress(coded, len(data)) == data
    assert decode_stream(coded, H.NAME, len(data)) == data
    # a stream that does not shrink is stored raw by encode_stream
    noise = np.random.default_rng(6).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    assert encode_stream(noise, H.NAME)[0] == "raw"


def test_golden_stream():
    # "aabcccc": counts a:2 b:1 c:4 -> lengths c=1, a=2, b=2; canonical (length, symbol) order: c=0, a=10,
    # b=11, written bit-reversed LSB-first: a a b c c c c -> bits 1,0, 1,0, 1,1, 0, 0, 0, 0 -> 0x35 in 10 bits
    enc = H.cpu_compress(b"aabcccc")
    expected = bytes.fromhex(
        "00" * 48  # symbols 0..95
        + "20"  # symbols 96 ('`': 0, low nibble), 97 ('a': 2, high nibble)
        + "12"  # symbols 98 ('b': 2), 99 ('c': 1)
        + "00" * 78  # symbols 100..255
        + "01000000"  # 1 block
        + "0100"  # of 1 word
        + "35000000"
    )
    assert enc == expected
    assert H.cpu_decompress(expected, 7) == b"aabcccc"
    table = H.decode_table(H.unpack_lengths(expected[:128]))
    assert table[0b0] == ord("c") | 1 << 8 and table[0b01] == ord("a") | 2 << 8 and table[0b11] == ord("b") | 2 << 8


def test_canonical_codes_deflate_rule():
    """Codes assigned in (length, symbol) order as RFC 1951 3.2.2 does it, then written first bit lowest."""
    r = np.random.default_rng(3)
    for _ in range(20):
        h = np.zeros(256, dtype=np.int64)
        idx = r.choice(256, int(r.integers(2, 257)), replace=False)
        h[idx] = (2.0 ** r.uniform(0, 20, len(idx))).astype(np.int64) + 1
        ln = H.code_lengths(h).astype(int)
        bl_count = [0] * 16
        for x in ln:
            bl_count[x] += 1
        bl_count[0] = 0
        code, next_code = 0, [0] * 16
        for bits in range(1, 16):
            code = (code + bl_count[bits - 1]) << 1
            next_code[bits] = code
        expected = [0] * 256
        for sym in range(256):
            if ln[sym]:
                c = next_code[ln[sym]]
                next_code[ln[sym]] += 1
                expected[sym] = int(f"{c:0{ln[sym]}b}"[::-1], 2)
        assert H.canonical_codes(ln).tolist() == expected
        et = H.encode_table(ln).view(np.uint16).astype(int)
        assert all(et[s] == (expected[s] | (ln[s] - 1) << 12) for s in range(256) if ln[s])


def test_code_lengths_limited_optimal_deterministic():
    r = np.random.default_rng(7)
    for trial in range(150):
        k = int(r.integers(2, 257))
        h = np.zeros(256, dtype=np.int64)
        idx = r.choice(256, k, replace=False)
        kind = trial % 3
        if kind == 0:
            h[idx] = r.integers(1, 1000, k)
        elif kind == 1:  # counts over 30 binary orders of magnitude: the 12-bit limit binds
            h[idx] = (2.0 ** r.uniform(0, 30, k)).astype(np.int64) + 1
        else:
            h[idx] = np.round(1e6 * np.exp(-np.arange(k) / 3.0)).astype(np.int64) + 1
        ln = H.code_lengths(h)
        assert ln.dtype == np.uint8 and ln.max() <= H.MAX_LEN and ((ln > 0) == (h > 0)).all()
        assert kraft(ln) == 1.0
        cost = int((ln.astype(np.int64) * h).sum())
        opt = huffman_cost(h)
        assert cost >= opt
        if ln.max() < H.MAX_LEN:
            assert cost == opt  # the limit did not bind: exactly Huffman's optimum
        assert (H.code_lengths(h.copy()) == ln).all()
    one = np.zeros(256, dtype=np.int64)
    one[9] = 5
    assert H.code_lengths(one)[9] == 1 and H.code_lengths(one).sum() == 1
    assert H.code_lengths(np.zeros(256)).sum() == 0


def test_code_lengths_batch_rows_independent():
    """The GPU coder builds every stream's lengths in one batch: each row equals the single-stream result."""
    r = np.random.default_rng(8)
    rows = [
        np.zeros(256, dtype=np.int64),
        np.eye(256, dtype=np.int64)[17] * 9,
        np.bincount(np.frombuffer(packed_int2(20000), dtype=np.uint8), minlength=256),
        np.bincount(np.frombuffer(packed_int4(20000), dtype=np.uint8), minlength=256),
        r.integers(1, 3, 256),
        np.where(r.random(256) < 0.1, r.integers(1, 10**9, 256), 0),
    ]
    batch = H.code_lengths_batch(np.stack(rows))
    for h, b in zip(rows, batch):
        assert (H.code_lengths(h) == b).all()
    tables = H.encode_tables(batch)
    for ln, t in zip(batch, tables):
        assert (H.encode_table(ln) == t).all()


def test_compression_near_entropy_and_zstd():
    int2 = packed_int2(1 << 20, seed=8)
    int4 = packed_int4(1 << 20, seed=9)
    for data, slack in ((int2, 0.015), (int4, 0.01)):
        enc = H.cpu_compress(data)
        blocks = -(-len(data) // H.BLOCK)
        overhead = H.HEAD + 2 * blocks + 4 * blocks  # header, word counts, up to one padding word a block
        # byte-wise Huffman is never below the order-0 entropy; for the int2 bytes (probabilities products
        # of 0.05/0.45) even an unlimited Huffman code is 1.1% above it, and the 12-bit limit adds 0.2%
        assert entropy_bytes(data) <= len(enc) <= (1 + slack) * entropy_bytes(data) + overhead
    zstandard = pytest.importorskip("zstandard")
    assert len(H.cpu_compress(int2)) <= len(zstandard.ZstdCompressor(level=3).compress(int2))
    assert len(H.cpu_compress(int4)) <= len(zstandard.ZstdCompressor(level=3).compress(int4))


def test_every_truncation_and_extension_rejected():
    data = packed_int2(2 * 4096 + 100, seed=10)
    enc = H.cpu_compress(data)
    for cut in range(len(enc)):
        with pytest.raises(FormatError):
            H.cpu_decompress(enc[:cut], len(data))
    for extra in (b"\0", b"\0" * 4):
        with pytest.raises(FormatError):
            H.cpu_decompress(enc + extra, len(data))
    for wrong in (0, 4096 * 2, 4096 * 3 + 1):  # another block count
        with pytest.raises(FormatError):
            H.cpu_decompress(enc, wrong)
    # the same block count, a few bytes off: refused unless the padding happens to read as codes of zero
    # bits (the container validates raw_len before this); never more or less than what was asked
    for wrong in range(len(data) - 8, len(data) + 9):
        try:
            out = H.cpu_decompress(enc, wrong)
        except FormatError:
            continue
        assert len(out) == wrong and (wrong == len(data) or out[: min(wrong, len(data))] == data[:wrong])


def test_header_corruptions():
    data = packed_int2(3 * 4096 + 5, seed=11)
    enc = H.cpu_compress(data)
    c = 4
    # the block count and every word count: always refused
    for pos in range(128, H.HEAD + 2 * c):
        for x in (0x01, 0x02, 0x10, 0x80, 0xFF):
            b = bytearray(enc)
            b[pos] ^= x
            with pytest.raises(FormatError):
                H.cpu_decompress(bytes(b), len(data))
    # code lengths: refused (not a complete code, > 12, or the blocks do not decode exactly), except a
    # change that keeps a complete code (two present symbols swapping lengths) and still decodes to exactly
    # its words: then a wrong but bounded output (the container's CRC-32 catches it first)
    raised = 0
    for pos in range(0, 128, 3):
        for x in (0x01, 0x11, 0xF0):
            b = bytearray(enc)
            b[pos] ^= x
            try:
                out = H.cpu_decompress(bytes(b), len(data))
            except FormatError:
                raised += 1
            else:
                assert len(out) == len(data)
    assert raised >= 0.9 * 43 * 3
    for nibble in (0xD0, 0x0F):  # a length above 12
        b = bytearray(enc)
        b[5] |= nibble
        with pytest.raises(FormatError, match="exceeds"):
            H.parse(bytes(b), len(data))


def test_payload_corruptions_bounded(monkeypatch):
    data = packed_int4(2 * 4096 + 77, seed=12)
    enc = H.cpu_compress(data)
    head = H.HEAD + 2 * 3
    r = np.random.default_rng(13)
    raised = 0
    for pos in r.integers(head, len(enc), 30):
        b = bytearray(enc)
        b[int(pos)] ^= 1 << int(r.integers(0, 8))
        out = decode_both(bytes(b), len(data), monkeypatch)  # the two decoders agree
        if out is None:
            raised += 1
        else:
            assert len(out) == len(data)
    assert raised > 0
    # a single-symbol stream: a 1 bit where only 0 codes exist is a table hole; a set padding bit is refused
    one = H.cpu_compress(b"\x07" * 100)
    for pos, bit in ((H.HEAD + 2, 0x01), (len(one) - 1, 0x80)):
        b = bytearray(one)
        b[pos] ^= bit
        assert decode_both(bytes(b), 100, monkeypatch) is None


def test_hostile_headers_rejected_before_allocating():
    lengths = np.zeros(256, dtype=np.uint8)
    lengths[:2] = 1
    nib = H.pack_lengths(lengths)
    # a huge declared size with a short stream
    with pytest.raises(FormatError):
        H.cpu_decompress(nib + struct.pack("<I", 1 << 28), (1 << 28) * 4096)
    # word counts above the per-block maximum
    c = 4
    huge = nib + struct.pack("<I", c) + struct.pack(f"<{c}H", *([0xFFFF] * c)) + b"\0" * (4 * 0xFFFF * c)
    with pytest.raises(FormatError, match="words"):
        H.cpu_decompress(huge, c * 4096)
    # 1 GiB declared over 2**18 blocks of one word each: consistent framing, but a 4096-byte block needs at
    # least 128 words: refused from the header alone, with no allocation of the declared size
    c = 1 << 18
    stream = nib + struct.pack("<I", c) + struct.pack(f"<{c}H", *([1] * c)) + b"\0" * (4 * c)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="byte counts"):
            H.cpu_decompress(stream, c * 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20
    # no symbols but bytes to produce; an incomplete code; an empty stream with bytes after its header
    empty = bytes(128) + struct.pack("<I", 1) + struct.pack("<H", 1) + b"\0" * 4
    with pytest.raises(FormatError):
        H.cpu_decompress(empty, 10)
    bad = lengths.copy()
    bad[2] = 1  # three codes of length 1
    with pytest.raises(FormatError, match="Kraft"):
        H.cpu_decompress(H.pack_lengths(bad) + struct.pack("<I", 1) + struct.pack("<H", 1) + b"\0" * 4, 10)
    with pytest.raises(FormatError):
        H.cpu_decompress(H.cpu_compress(b"") + b"\0" * 4, 0)


@pytest.mark.parametrize("group", [1, 2, 3])
def test_multi_group_decode(monkeypatch, group):
    """Blocks decoded in several groups, with a short last block (the grouping is invisible)."""
    monkeypatch.setattr(H, "_DEC_GROUP", group)
    monkeypatch.setattr(H, "_PY_BLOCKS", 0)
    data = packed_int2(4 * H.BLOCK + 9, seed=14)
    assert H.cpu_decompress(H.cpu_compress(data), len(data)) == data


def test_no_gpu_coder_here():
    assert device_coder("zstd", "cuda") is None  # a CPU-only backend
    assert device_coder(H.NAME, "cpu") is None  # not a CUDA device
    assert device_coder("no-such-backend", "cuda") is None
