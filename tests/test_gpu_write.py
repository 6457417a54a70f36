"""The device container writer (kvtc.codec.gpu_write) and the GPU CRC-32 kernel against the general writer and
zlib (CUDA, or Triton's CPU interpreter with ``TRITON_INTERPRET=1``; skipped otherwise).

The writer must produce the bytes :func:`kvtc.codec.container.write` produces for the same streams: into a fresh
``bytes``, into a caller's buffer, with a stream that does not shrink (stored raw) and host-side sections mixed
in; and a buffer that is too small is refused untouched.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch

from kvtc import KVLayout
from kvtc.codec import container, gpu_write
from kvtc.codec.crc import crc32_combine
from kvtc.coding.buffers import host_bytes
from kvtc.coding.entropy import Precoded
from kvtc.coding.huffman_gpu import DeviceCoder
from kvtc.errors import OutputBufferError

triton = pytest.importorskip("triton")

if torch.cuda.is_available():
    DEVICE, SCALE = "cuda", 16
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE, SCALE = "cpu", 1
else:
    pytest.skip("needs CUDA and Triton (or TRITON_INTERPRET=1)", allow_module_level=True)

pytestmark = pytest.mark.gpu


def _header() -> container.Header:
    lay = KVLayout(layers=(0, 1), num_kv_heads=1, head_dim=8, dtype="bfloat16")
    return container.Header("identity", None, "m", lay, 1, 4096, 4096, 0, None, "bits")


def _payloads() -> list[tuple[str, object]]:
    r = np.random.default_rng(0)
    skew = r.choice(4, size=SCALE * 4096 * 3 + 333, p=(0.6, 0.3, 0.07, 0.03)).astype(np.uint8)
    noise = r.integers(0, 256, 5000, dtype=np.uint8)  # does not shrink: stored raw
    small = np.tile(np.arange(7, dtype=np.uint8), 100)
    return [
        ("positions", b"\x01\x02" * 300),
        ("a", torch.from_numpy(skew).to(DEVICE)),
        ("b", torch.from_numpy(noise).to(DEVICE)),
        ("c", torch.from_numpy(small).to(DEVICE)),
        ("d", torch.zeros(0, dtype=torch.uint8, device=DEVICE)),
        ("e", torch.from_numpy(np.repeat(skew[:4096], 2)).to(DEVICE)),  # exactly two whole chunks
    ]


def _reference(payloads, coder) -> bytes:
    dev = [(i, d) for i, (_, d) in enumerate(payloads) if isinstance(d, torch.Tensor)]
    coded = coder.encode([d for _, d in dev])
    out = list(payloads)
    for (i, d), c in zip(dev, coded):
        out[i] = (payloads[i][0], Precoded("huff4k", c, d.numel(), lambda d=d: host_bytes(d)))
    return bytes(container.write(_header(), out, "huff4k"))


def test_device_writer_matches_the_general_writer():
    coder = DeviceCoder(DEVICE)
    payloads = _payloads()
    ref = _reference(payloads, coder)
    blob = gpu_write.write(_header(), payloads, "huff4k", coder)
    assert isinstance(blob, bytes) and blob == ref
    header, body = container.read_header(blob)
    assert [s.backend for s in header.sections] == ["huff4k", "huff4k", "raw", "huff4k", "raw", "huff4k"]
    secs = container.read_sections(blob, header, body)  # every CRC checked, every stream decoded on the CPU
    for name, d in payloads:
        want = d if isinstance(d, bytes) else d.cpu().numpy().tobytes()
        assert bytes(secs[name]) == want
    buf = torch.full((len(ref) + 100,), 7, dtype=torch.uint8)
    view = gpu_write.write(_header(), payloads, "huff4k", coder, out=buf)
    assert bytes(view.numpy()) == ref and int(buf[len(ref)]) == 7
    arr = bytearray(len(ref))
    assert bytes(gpu_write.write(_header(), payloads, "huff4k", coder, out=arr)) == ref
    small = torch.full((len(ref) - 1,), 7, dtype=torch.uint8)
    with pytest.raises(OutputBufferError) as e:
        gpu_write.write(_header(), payloads, "huff4k", coder, out=small)
    assert e.value.needed == len(ref) and bool((small == 7).all())


def test_region_crcs_equal_zlib():
    from kvtc.kernels.triton_crc import CHUNK, region_crcs

    r = np.random.default_rng(1)
    words = r.integers(-(2**31), 2**31 - 1, size=1024 * (3 * SCALE + 4) + 77, dtype=np.int64).astype(np.int32)
    raw = words.tobytes()
    regions = [(0, 4 * 1024 * 3 * SCALE + 40), (5, 0), (9, CHUNK), (1024 * 2 + 3, 4 * 1024 * 4 + 8), (100, 16)]
    full, counts = region_crcs(torch.from_numpy(words).to(DEVICE), regions)
    for (w, n), c, k in zip(regions, full.cpu().tolist(), counts):
        head, tail = raw[4 * w : 4 * w + k * CHUNK], raw[4 * w + k * CHUNK : 4 * w + n]
        assert c == (zlib.crc32(head) if k else 0)
        whole = crc32_combine(c, zlib.crc32(tail), len(tail)) if k else zlib.crc32(tail)
        assert whole == zlib.crc32(raw[4 * w : 4 * w + n])


def test_streams_that_shrink_far_are_padded_as_the_general_writer_pads_them():
    """An all-zero cache shrinks far more than the decoder allows a blob's bytes to pay for (docs/FORMAT.md,
    "Decoding allowance"): both writers append the same raw ``pad`` section, and the blob reads back."""
    from kvtc.codec import budget
    from kvtc.codec.header import PAD_SECTION

    coder = DeviceCoder(DEVICE)
    zeros = torch.zeros(SCALE * 4096 * 64, dtype=torch.uint8, device=DEVICE)
    payloads = [("positions", b"\x01\x02" * 300), ("a", zeros)]
    ref = _reference(payloads, coder)
    blob = gpu_write.write(_header(), payloads, "huff4k", coder)
    assert blob == ref
    header, body = container.read_header(blob)
    pad = header.sections[-1]
    assert pad.name == PAD_SECTION and pad.backend == "raw" and pad.raw == pad.coded > 0, header.sections
    streams = header.sections[:-1]
    assert sum(s.raw for s in streams) > budget.MAX_CODER_GAIN * sum(s.coded for s in streams)  # it needed one
    assert sum(s.raw for s in streams) <= budget.MAX_CODER_GAIN * sum(s.coded for s in header.sections)
    secs = container.read_sections(blob, header, body)
    assert bytes(secs["a"]) == bytes(len(zeros))
