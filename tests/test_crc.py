"""Parallel CRC-32: pieces joined by crc32_combine equal zlib's CRC of the whole; containers whose sections
arrive in several parts (GPU coders) carry the same checksums as joined ones."""

from __future__ import annotations

import json
import os
import random
import zlib

from kvtc.codec import crc
from kvtc.codec.container import Header, write
from kvtc.codec.entropy import Parts, Precoded
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
