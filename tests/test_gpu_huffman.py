"""The ``huff4k`` GPU coder (Triton) against its CPU twin (skipped without CUDA and Triton).

GPU streams must equal :func:`kvtc.coding.huffman.cpu_compress` byte for byte (one batched launch over
streams of mixed sizes and tables), GPU decoding of CPU streams must give back the input, a corrupt block
must raise FormatError through the kernel's error flag, and a corrupt-but-well-framed stream decodes to the
same bytes on both sides. With ``TRITON_INTERPRET=1`` and no GPU the same tests run on small inputs through
Triton's CPU interpreter (slow, for debugging the kernels' logic).
"""

from __future__ import annotations

import os
import types
import zlib

import numpy as np
import pytest
import torch

from kvtc.coding import huffman as H
from kvtc.coding import huffman_gpu as HG
from kvtc.coding.entropy import device_coder
from kvtc.errors import FormatError

triton = pytest.importorskip("triton")

if torch.cuda.is_available():
    DEVICE, SCALE = "cuda", 64
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE, SCALE = "cpu", 1
else:
    pytest.skip("needs CUDA and Triton (or TRITON_INTERPRET=1)", allow_module_level=True)

pytestmark = pytest.mark.gpu


def _int2(n: int, seed: int) -> np.ndarray:
    s = np.random.default_rng(seed).choice(4, size=(n, 4), p=(0.05, 0.45, 0.45, 0.05)).astype(np.uint8)
    return (s[:, 0] | s[:, 1] << 2 | s[:, 2] << 4 | s[:, 3] << 6).astype(np.uint8)


def _int4(n: int, seed: int) -> np.ndarray:
    q = np.clip(np.round(np.random.default_rng(seed).normal(7.5, 2.0, size=(n, 2))), 0, 15).astype(np.uint8)
    return (q[:, 0] | q[:, 1] << 4).astype(np.uint8)


def _streams() -> list[np.ndarray]:
    r = np.random.default_rng(0)
    return [
        _int2(SCALE * 4096 * 4 + 999, 1),
        np.zeros(0, dtype=np.uint8),
        np.full(5, 7, dtype=np.uint8),
        np.frombuffer(b"aab", dtype=np.uint8).copy(),
        r.integers(0, 256, 4096 + 13, dtype=np.uint8),
        _int4(SCALE * 4096 * 3 + 1, 2),
        np.tile(np.arange(256, dtype=np.uint8), 17),
        r.choice(256, SCALE * 4096 + 4096, p=r.dirichlet(np.full(256, 0.05))).astype(np.uint8),
        np.full(3 * 4096, 255, dtype=np.uint8),
    ]


@pytest.fixture(scope="module")
def coder():
    if DEVICE == "cuda":
        c = device_coder(H.NAME, "cuda")
        assert c is not None
        assert device_coder("raw", "cuda") is None
        return c
    return HG.DeviceCoder("cpu")


def test_gpu_encode_matches_cpu(coder):
    data = _streams()
    got = coder.compress([torch.from_numpy(d).to(DEVICE) for d in data])
    for d, g in zip(data, got):
        assert g == H.cpu_compress(d.tobytes()), len(d)
    # a single tensor (the no-copy path when aligned) and an unaligned view
    one = torch.from_numpy(_int2(4096 * 2, 3)).to(DEVICE)
    assert coder.compress([one]) == [H.cpu_compress(one.cpu().numpy().tobytes())]
    view = one[1:]
    assert coder.compress([view]) == [H.cpu_compress(view.cpu().numpy().tobytes())]


def test_gpu_decode_of_cpu_streams(coder):
    data = _streams()
    enc = [H.cpu_compress(d.tobytes()) for d in data]
    dec = coder.decompress(enc, [len(d) for d in data])
    for d, t in zip(data, dec):
        assert t.device.type == DEVICE and t.dtype == torch.uint8 and t.numel() == len(d)
        assert np.array_equal(t.cpu().numpy(), d)
    # memoryview inputs (what read_sections hands over)
    dec = coder.decompress([memoryview(e) for e in enc[:2]], [len(d) for d in data[:2]])
    assert np.array_equal(dec[0].cpu().numpy(), data[0])


@pytest.mark.parametrize(
    "cfg",
    [
        dict(lanes=32, warps=1, vec=4, prefetch=0),
        dict(lanes=64, warps=2, vec=8, prefetch=1),
        dict(lanes=128, warps=4, vec=8, prefetch=1),
    ],
)
def test_kernel_settings(coder, cfg, monkeypatch):
    """Every launch setting the benchmark sweeps writes and reads the same bytes."""
    from kvtc.kernels import triton_huffman as K

    monkeypatch.setattr(K, "ENCODE_CFG", {**K.ENCODE_CFG, **cfg})
    monkeypatch.setattr(K, "DECODE_CFG", {**K.DECODE_CFG, **cfg})
    data = [_int2(4096 * 2 + 5, 7), np.frombuffer(b"aab", dtype=np.uint8).copy(), _int4(4096 * 3, 8)]
    got = coder.compress([torch.from_numpy(d).to(DEVICE) for d in data])
    assert got == [H.cpu_compress(d.tobytes()) for d in data]
    dec = coder.decompress(got, [len(d) for d in data])
    assert all(np.array_equal(t.cpu().numpy(), d) for t, d in zip(dec, data))


@pytest.mark.parametrize("kind", ["histogram", "onehot"])
def test_block_histograms(kind):
    from kvtc.kernels import triton_huffman as K

    data = torch.from_numpy(_int4(4 * 4096, 9)).to(DEVICE)
    blk_src = torch.tensor([0, 4096, 8192, 12288], dtype=torch.int64, device=DEVICE)
    blk_n = torch.tensor([4096, 4096, 4096, 4093], dtype=torch.int32, device=DEVICE)
    got = K.block_hist(data, blk_src, blk_n, kind=kind).cpu().numpy()
    host = data.cpu().numpy()
    for i in range(4):
        s, n = 4096 * i, int(blk_n[i])
        assert (got[i] == np.bincount(host[s : s + n], minlength=256)).all()


def test_error_flag_raises(coder):
    one = H.cpu_compress(b"\x07" * 100)
    for pos, bit in ((H.HEAD + 2, 0x01), (len(one) - 1, 0x80)):  # a table hole; a set padding bit
        b = bytearray(one)
        b[pos] ^= bit
        with pytest.raises(FormatError):
            coder.decompress([H.cpu_compress(b"ok" * 3000), bytes(b)], [6000, 100])
    b = bytearray(H.cpu_compress(b"abc" * 5000))
    b[H.HEAD] ^= 0x40  # a word count: refused on the host before any copy
    with pytest.raises(FormatError):
        coder.decompress([bytes(b)], [15000])


def test_corrupt_payload_same_as_cpu(coder):
    data = _int4(2 * 4096 + 77, 4).tobytes()
    enc = H.cpu_compress(data)
    r = np.random.default_rng(5)
    for pos in r.integers(H.HEAD + 6, len(enc), 12 if DEVICE == "cuda" else 3):
        b = bytearray(enc)
        b[int(pos)] ^= 1 << int(r.integers(0, 8))
        try:
            cpu = H.cpu_decompress(bytes(b), len(data))
        except FormatError:
            cpu = None
        try:
            gpu = coder.decompress([bytes(b)], [len(data)])[0].cpu().numpy().tobytes()
        except FormatError:
            gpu = None
        assert cpu == gpu


def test_decode_in_parts_into_one_buffer(coder):
    """Streams staged in two block ranges (the restore's first component range, then the rest) decode into one
    buffer: after the first part its blocks hold their bytes, after the second every stream is whole; from bytes
    and (on CUDA) straight from a pinned blob."""
    data = _streams()
    enc = [H.cpu_compress(d.tobytes()) for d in data]
    lens = [len(d) for d in data]
    nblk = [-(-n // H.BLOCK) for n in lens]
    cut = [min(b, 1 + i % 3) for i, b in enumerate(nblk)]  # 1 to 3 blocks first (or all of a short stream)
    offs = np.cumsum([0, *map(len, enc)])[:-1].tolist()
    blob = b"".join(enc)
    sources = [None]
    if torch.cuda.is_available():
        sources.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8).pin_memory())
    for src in sources:
        pinned = None if src is None else (src, offs)
        st = coder.stage(enc, lens, pinned, blocks=[(0, c) for c in cut])
        out = torch.full((st["out_bytes"] + 16,), 0xA5, dtype=torch.uint8, device=DEVICE)
        err = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        first = coder.decode_device(st, err, out=out)
        for d, t, c in zip(data, first, cut):
            n = min(len(d), c * H.BLOCK)
            assert np.array_equal(t[:n].cpu().numpy(), d[:n])
        st2 = coder.stage(enc, lens, pinned, blocks=[(c, b) for c, b in zip(cut, nblk)], parsed=st["parsed"])
        whole = coder.decode_device(st2, err, out=out)
        coder.check(err)
        for d, t in zip(data, whole):
            assert np.array_equal(t.cpu().numpy(), d)
    with pytest.raises(ValueError, match="blocks"):
        coder.stage(enc[:1], lens[:1], blocks=[(0, nblk[0] + 1)])
    with pytest.raises(ValueError, match="out"):
        coder.decode_device(coder.stage(enc[:1], lens[:1]), out=torch.empty(8, dtype=torch.uint8, device=DEVICE))


def test_read_sections_mixed_backends(coder):
    from kvtc.coding.entropy import encode_stream

    raw = {"a": _int2(4096 * 3 + 1, 6).tobytes(), "b": b"xyz" * 100, "c": _int4(5000, 7).tobytes()}
    coded = {
        "a": (H.NAME, H.cpu_compress(raw["a"])),
        "b": encode_stream(raw["b"], "zlib"),
        "c": (H.NAME, H.cpu_compress(raw["c"])),
    }
    sections = [
        types.SimpleNamespace(name=k, backend=v[0], raw=len(raw[k]), coded=len(v[1]), crc32=zlib.crc32(v[1]))
        for k, v in coded.items()
    ]
    header = types.SimpleNamespace(sections=sections)
    blob = b"HDR" + b"".join(v[1] for v in coded.values())
    from kvtc.codec.container import read_sections

    expected = {k: len(v) for k, v in raw.items()}
    sources = [None]
    if torch.cuda.is_available():
        sources.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8).pin_memory())
    for src in sources:  # bytes (staged through pinned memory) or a blob already in pinned memory
        out = read_sections(blob, header, 3, expected, coder, H.NAME, src)
        assert list(out) == ["a", "b", "c"]
        assert np.array_equal(out["a"].cpu().numpy(), np.frombuffer(raw["a"], np.uint8))
        assert out["b"] == raw["b"]
        assert np.array_equal(out["c"].cpu().numpy(), np.frombuffer(raw["c"], np.uint8))
    for pos in (10, len(blob) - 5):  # a code-length byte, a payload word: the checksum reports it first
        bad = bytearray(blob)
        bad[pos] ^= 1
        with pytest.raises(FormatError, match="checksum"):
            read_sections(bytes(bad), header, 3, expected, coder, H.NAME)
