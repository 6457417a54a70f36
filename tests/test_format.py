"""The container and calibration files: byte-exact fixtures, rejection of every corruption and of older formats."""

from __future__ import annotations

import shutil
import struct
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvtc import KVSlice
from kvtc.calibration import Calibration, Recipe, fit_calibration
from kvtc.codec import Codec, container
from kvtc.errors import CalibrationError, CalibrationMismatch, FormatError

FIX = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def cal():
    return Calibration.load(FIX / "calibration.safetensors")


@pytest.fixture(scope="module")
def blob():
    return (FIX / "sample.kvtc").read_bytes()


def _decodes_and_reencodes_byte_exactly(here: Path) -> tuple[Calibration, bytes]:
    """The fixture set in ``here``: its blob decodes byte for byte to the checked-in tensors, and its slice
    re-encodes to the same bytes."""
    cal = Calibration.load(here / "calibration.safetensors")
    blob = (here / "sample.kvtc").read_bytes()
    assert Codec.inspect(blob)["calibration"] == cal.hash
    codec = Codec(cal, ratio=8, sinks=2, window=4)
    out = codec.decode(blob)
    want = load_file(str(here / "sample_decoded.safetensors"))
    for name in ("keys", "values", "positions"):
        got = getattr(out, name)
        assert got.dtype == want[name].dtype and torch.equal(got, want[name]), name
    inp = load_file(str(here / "sample_input.safetensors"))
    kv = KVSlice(cal.layout, inp["keys"], inp["values"], inp["positions"], model_id="fixture")
    assert codec.encode(kv) == blob
    return cal, blob


def test_small_fixture_decodes_byte_exactly_and_reencodes_to_the_same_bytes():
    cal, blob = _decodes_and_reencodes_byte_exactly(FIX)
    info = Codec.inspect(blob)
    assert info["model_id"] == "fixture" and info["version"] == 1
    assert (info["tokens"], info["sinks"], info["window"], info["middle_tokens"]) == (40, 2, 4, 34)
    assert info["bytes"] == len(blob)


CURRENT = FIX / "current"


def test_current_fixture_uses_every_cpu_coder_and_reencodes_byte_exactly():
    """Today's encoder: fixed-step planes under their Gaussians (``gauss``), positions delta coded
    (``zstd-delta64``), the calibration's PCA bases stored as float16."""
    cal, blob = _decodes_and_reencodes_byte_exactly(CURRENT)
    assert all(p.basis.dtype == torch.float16 for kind in ("keys", "values") for p in cal.pcas[kind])
    backends = {s["backend"] for s in Codec.inspect(blob)["sections"]}
    assert {"gauss", "zstd-delta64"} <= backends


LEGACY = FIX / "legacy"


@pytest.mark.parametrize("version", [1, 9, 10])
def test_calibration_files_of_older_versions_are_refused_saying_to_rebuild(version):
    """Files of the formats kvtc no longer reads (the first encoder's version 1, the float32 bases of version 9,
    the float16 token map of version 10) are refused by their version, with the fix."""
    with pytest.raises(CalibrationError, match=rf"(?i)version {version}\b.*rebuild"):
        Calibration.load(LEGACY / f"calibration-v{version}.safetensors")


def test_current_fixture_rejects_every_flip_of_its_gauss_streams():
    cal = Calibration.load(CURRENT / "calibration.safetensors")
    blob = (CURRENT / "sample.kvtc").read_bytes()
    codec = Codec(cal, ratio=8, sinks=2, window=4)
    header, body = container.read_header(blob)
    off, flipped = body, 0
    for s in header.sections:
        if s.backend == "gauss":
            for i in range(off, off + s.coded):
                bad = bytearray(blob)
                bad[i] ^= 0x5A
                with pytest.raises(FormatError):
                    codec.decode(bytes(bad))
                flipped += 1
        off += s.coded
    assert flipped > 100


def test_every_single_byte_flip_is_rejected(cal, blob):
    codec = Codec(cal, ratio=8, sinks=2, window=4)
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0xFF
        with pytest.raises(FormatError):
            codec.decode(bytes(bad))


def test_every_truncation_and_extension_is_rejected(cal, blob):
    codec = Codec(cal, ratio=8, sinks=2, window=4)
    for n in range(len(blob)):
        with pytest.raises(FormatError):
            codec.decode(blob[:n])
    with pytest.raises(FormatError):
        codec.decode(blob + b"\x00")


def test_header_with_valid_crc_but_hostile_sizes_is_rejected_before_allocation(cal, blob):
    header, _ = container.read_header(blob)
    d = header.to_json()
    d["tokens"] = 1 << 40
    _reseal_raises(d, blob)
    d = header.to_json()
    d["sections"][0][2] = 1 << 50  # huge raw size
    _reseal_raises(d, blob)
    d = header.to_json()
    d["sections"][1][1] = "../../evil"
    _reseal_raises(d, blob, decode_with=Codec(cal, ratio=8, sinks=2, window=4))
    d = header.to_json()
    d["layout"]["layers"] = [3, 0]
    _reseal_raises(d, blob)


def _reseal_raises(d, blob, decode_with=None):
    import json

    hdr = json.dumps(d, separators=(",", ":"), sort_keys=True).encode()
    _, body = container.read_header(blob)
    rest = blob[body:]
    new = struct.pack("<4sHHII", b"KVTC", 1, 0, len(hdr), zlib.crc32(hdr)) + hdr + rest
    with pytest.raises(FormatError):
        if decode_with is None:
            container.read_header(new)
        else:
            decode_with.decode(new)


def test_blob_decoded_with_another_calibration_is_refused(cal, blob):
    layout = cal.layout
    g = torch.Generator().manual_seed(9)
    rows = [torch.randn(300, layout.num_features, generator=g)]
    other = fit_calibration(layout, list(zip(rows, rows)), Recipe(ratios=(8,), dp_rows=128))
    with pytest.raises(CalibrationMismatch):
        Codec(other, ratio=8).decode(blob)
    with pytest.raises(CalibrationMismatch):
        Codec.identity().decode(blob)


def test_calibration_file_corruption_is_refused(tmp_path, cal):
    src = FIX / "calibration.safetensors"
    data = src.read_bytes()
    # truncated
    (tmp_path / "t.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CalibrationError):
        Calibration.load(tmp_path / "t.safetensors")
    # one flipped byte in the tensor data: its checksum (or the content hash) no longer matches
    bad = bytearray(data)
    bad[-5] ^= 0x01
    (tmp_path / "f.safetensors").write_bytes(bytes(bad))
    with pytest.raises(CalibrationError, match="hash|checksum"):
        Calibration.load(tmp_path / "f.safetensors")
    with pytest.raises(CalibrationError):
        Calibration.load(tmp_path / "missing.safetensors")
    (tmp_path / "g.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(CalibrationError):
        Calibration.load(tmp_path / "g.safetensors")
    # round trip through save keeps the hash; saving over a good file is atomic
    shutil.copy(src, tmp_path / "c.safetensors")
    cal.save(tmp_path / "c.safetensors")
    assert Calibration.load(tmp_path / "c.safetensors").hash == cal.hash
