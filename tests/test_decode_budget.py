"""Decoding budget: a blob that declares far more decoded bytes than it can honestly hold is refused with a
FormatError before anything large is allocated (peak memory growth < 64 MiB, < 1 s), whatever its payloads.

The hostile blobs are real containers with valid checksums and the real calibration hash of the checked-in
fixture calibration: made by the encoder itself from an all-zero cache (zstd shrinks its streams to almost
nothing), or a real blob whose header declares a larger batch and token count, re-sealed with a valid CRC.
"""

from __future__ import annotations

import json
import re
import struct
import time
import zlib
from pathlib import Path

import pytest
import torch

from kvtc import KVSlice
from kvtc.calibration import Calibration
from kvtc.codec import Codec, budget, container
from kvtc.errors import FormatError

FIX = Path(__file__).parent / "fixtures"
PREFIX = struct.Struct("<4sHHII")
_HWM = re.compile(rb"VmHWM:\s+(\d+) kB")


@pytest.fixture(scope="module")
def cal() -> Calibration:
    return Calibration.load(FIX / "calibration.safetensors")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm() -> int:
    with open("/proc/self/status", "rb") as f:
        m = _HWM.search(f.read())
    return int(m.group(1)) * 1024 if m else 0


def _refused_cheaply(codec: Codec, blob: bytes) -> str:
    """Decode ``blob``, expecting a FormatError; assert the attempt's peak memory growth and time."""
    can_measure = _reset_hwm()
    base = _hwm()
    t0 = time.perf_counter()
    with pytest.raises(FormatError) as err:
        codec.decode(blob)
    with pytest.raises(FormatError):
        list(codec.decode_layers(blob))
    spent = time.perf_counter() - t0
    grown = _hwm() - base
    assert spent < 1.0, f"refusal took {spent:.2f} s"
    if can_measure:
        assert grown < 64 << 20, f"peak memory grew by {grown >> 20} MiB"
    return str(err.value)


def _zero_slice(cal: Calibration, batch: int, tokens: int) -> KVSlice:
    lay = cal.layout
    shape = (batch, tokens, len(lay.layers), len(lay.heads), lay.head_dim)
    zeros = torch.zeros(shape, dtype=torch.bfloat16)
    positions = torch.arange(tokens).expand(batch, tokens).contiguous()
    return KVSlice(lay, zeros, zeros.clone(), positions, model_id="fixture")


def _reseal(blob: bytes, **fields) -> bytes:
    """The blob with header fields replaced and a valid header CRC (its sections unchanged)."""
    _, version, flags, hlen, _ = PREFIX.unpack_from(blob, 0)
    head = json.loads(blob[PREFIX.size : PREFIX.size + hlen])
    head.update(fields)
    raw = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
    return PREFIX.pack(b"KVTC", version, flags, len(raw), zlib.crc32(raw)) + raw + blob[PREFIX.size + hlen :]


def _zeros_frame(n: int) -> bytes:
    """A real zstd frame of ``n`` zero bytes (tens of bytes for megabytes)."""
    import zstandard

    comp = zstandard.ZstdCompressor(level=3).compressobj(size=n)
    chunk = bytes(min(n, 1 << 22))
    parts, left = [], n
    while left:
        parts.append(comp.compress(chunk[: min(left, len(chunk))]))
        left -= min(left, len(chunk))
    return b"".join(parts) + comp.flush()


def _inflated(codec: Codec, blob: bytes, batch: int, tokens: int) -> bytes:
    """A well-formed blob for ``batch`` x ``tokens`` tokens: the real blob's header with larger counts and
    every section an honest zstd stream of zeros of exactly the size the decoder expects, checksums valid."""
    fields = {"batch": batch, "tokens": tokens}
    if codec.mode == "identity":  # every token of an identity blob is stored raw: its window covers them all
        fields.update(sinks=0, window=tokens)
    header, _ = container.read_header(_reseal(blob, **fields))
    expected = codec._expected_sections(header)
    frames = {name: _zeros_frame(n) for name, n in expected.items()}
    sections = [[name, "zstd", expected[name], len(f), zlib.crc32(f)] for name, f in frames.items()]
    return _reseal(blob, **fields, sections=sections)[: -sum(s.coded for s in header.sections) or None] + b"".join(
        frames.values()
    )


@pytest.mark.parametrize("mode", ["kvtc", "identity"])
def test_zstd_blob_declaring_1000x_is_refused(cal, mode):
    codec = Codec(cal, ratio=8, sinks=2, window=4) if mode == "kvtc" else Codec.identity(backend="zstd")
    honest = codec.encode(_zero_slice(cal, batch=1, tokens=40))
    assert codec.decode(honest).keys.shape[1] == 40
    for batch, tokens in ((1, 1 << 16), (4, 1 << 18)):
        blob = _inflated(codec, honest, batch, tokens)
        header, _ = container.read_header(blob)
        declared = budget.decoded_bytes(header)
        assert declared >= 1000 * len(blob), (declared, len(blob))
        msg = _refused_cheaply(codec, blob)
        assert "decoded bytes" in msg and "hostile" in msg


@pytest.mark.parametrize("backend", ["zstd", "raw"])
def test_header_declaring_a_huge_slice_is_refused_before_allocation(cal, backend):
    codec = Codec(cal, ratio=8, sinks=2, window=4, backend=backend)
    lay = cal.layout
    n = 40
    kv = KVSlice(
        lay,
        torch.randn(1, n, 2, 2, 8).bfloat16(),
        torch.randn(1, n, 2, 2, 8).bfloat16(),
        torch.arange(n)[None],
        model_id="fixture",
    )
    blob = codec.encode(kv)
    assert codec.decode(blob).keys.shape[1] == n  # the honest blob decodes
    for batch, tokens in ((4096, 1 << 22), (1, 1 << 22), (1024, 40)):
        hostile = _reseal(blob, batch=batch, tokens=tokens)
        header, _ = container.read_header(hostile)
        assert budget.decoded_bytes(header) >= 1000 * len(hostile)
        _refused_cheaply(codec, hostile)


def test_max_decoded_bytes_is_configurable_and_honest_blobs_decode(cal):
    kv = _zero_slice(cal, batch=1, tokens=512)
    kv.keys.normal_()
    kv.values.normal_()
    blob = Codec(cal, ratio=8).encode(kv)
    need = budget.decoded_bytes(container.read_header(blob)[0])
    assert Codec(cal, ratio=8, max_decoded_bytes=need).decode(blob).keys.shape == kv.keys.shape
    with pytest.raises(FormatError, match="max_decoded_bytes"):
        Codec(cal, ratio=8, max_decoded_bytes=need - 1).decode(blob)


def test_budget_refuses_nonsense_ratio(cal):
    blob = (FIX / "sample.kvtc").read_bytes()
    for ratio in ("abc", "0", "-3", "1e9"):
        with pytest.raises(FormatError, match="ratio"):
            budget.check_budget(container.read_header(_reseal(blob, ratio=ratio))[0], len(blob))
