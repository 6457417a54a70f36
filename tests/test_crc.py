"""Parallel CRC-32: pieces joined by crc32_combine equal zlib's CRC of the whole; containers whose sections
arrive in several parts (GPU coders) carry the same checksums as joined ones; the powers the GPU CRC joins its chunks
with; a new ``bytes`` written in place (the GPU writer's result)."""

from __future__ import annotations

import json
import os
import random
import zlib

import numpy as np

from kvtc.codec import crc
from kvtc.codec.container import Header, write
from kvtc.coding.entropy import Parts, Precoded
from kvtc.layout import KVLayout


def test_combine_equals_crc_of_the_concatenation() -> None:
    rnd = random.Random(0)
    for _ in range(200):
        a = os.urandom(rnd.randint(0, 3000))
        b = os.urandom(rnd.randint(0, 3000))
        assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_pieces_on_threads_equal_zlib(monkeypatch) -> None:
    monkeypatch.setattr(crc, "PIECE", 1 << 16)  # many pieces even for small buffers
    bufs = [
        b"",
        os.urandom(1),
        os.urandom((1 << 16) * 5 + 7),
        bytearray(os.urandom(300_000)),
        memoryview(os.urandom(1 << 17)),
    ]
    assert crc.crc32_many(bufs) == [zlib.crc32(b) for b in bufs]
    assert crc.crc32_submit(bufs).result() == [zlib.crc32(b) for b in bufs]


def test_sections_in_parts_write_the_same_container() -> None:
    lay = KVLayout(layers=(0,), num_kv_heads=1, head_dim=2, dtype="float32")

    def header() -> Header:
        return Header("identity", None, "m", lay, 1, 1, 1, 0, None, "bits")

    data = os.urandom(200_000)
    whole = write(header(), [("x", Precoded("raw", data, len(data) + 1, lambda: data))], "raw")
    parts = Parts([data[:5], memoryview(data)[5:150_000], data[150_000:]])
    split = write(header(), [("x", Precoded("raw", parts, len(data) + 1, lambda: data))], "raw")
    assert split == whole
    hlen = int.from_bytes(whole[8:12], "little")
    meta = json.loads(whole[16 : 16 + hlen])
    assert meta["sections"] == [["x", "raw", len(data) + 1, len(data), zlib.crc32(data)]]
    assert whole.endswith(data)


def test_chunk_powers_are_the_shifts_crc32_combine_uses():
    from kvtc.codec.crc import _shift, chunk_powers

    p = chunk_powers(4096, 70)
    assert [int(x) for x in p] == [_shift(4096 * j) for j in range(70)]
    # the sum over chunks of crc(chunk)·x^(8·bytes after it) is the CRC of their concatenation
    from kvtc.codec.crc import _multmodp

    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 256, 4096, dtype=np.uint8).tobytes() for _ in range(5)]
    acc = 0
    for i, c in enumerate(chunks):
        acc ^= _multmodp(int(p[len(chunks) - 1 - i]), zlib.crc32(c))
    assert acc == zlib.crc32(b"".join(chunks))


def test_new_bytes_is_a_bytes_object_written_once():
    from kvtc.coding.buffers import new_bytes

    made = new_bytes(1000)
    if made is None:  # not CPython
        return
    obj, view = made
    view[:] = np.arange(1000) % 251
    assert type(obj) is bytes and len(obj) == 1000 and obj == (np.arange(1000) % 251).astype(np.uint8).tobytes()
    assert hash(obj) == hash(bytes(obj))
