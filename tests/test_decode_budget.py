"""The decoding allowance (docs/FORMAT.md, "Decoding allowance"): what a blob may cost to decode comes from facts the
decoder checked against the calibration and from the blob's own bytes; no header field can raise it.

For every encode mode (identity, one plan, one plan with a sliding-window layer, two tiers, rate ladder, token map:
container versions 1-5) a real blob's header is forged, one field that enters the allowance at a time (batch,
tokens, sinks and window, ratio, tier names and share, rungs and their counts, the token-id flag, section sizes,
the pad section), and its sections are replaced by honest zstd streams of zeros of exactly the sizes the forged header implies, checksums valid: the
most a writer of a shared store can do. Every such blob is refused with a FormatError before anything large is
allocated (< 1 s, < 64 MiB more resident memory), for ``decode`` and ``decode_layers`` alike.
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
from safetensors.torch import load_file

from kvtc import KVSlice
from kvtc.calibration import Calibration
from kvtc.codec import Codec, budget, container
from kvtc.codec.header import PAD_SECTION, canonical_ratio, parse_header
from kvtc.errors import CalibrationMismatch, FormatError
from test_tiers import tiered_calibration, tiered_slice

FIX = Path(__file__).parent / "fixtures"
PREFIX = struct.Struct("<4sHHII")
_HWM = re.compile(rb"VmHWM:\s+(\d+) kB")


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
    """Decode ``blob`` both ways, expecting a FormatError; assert the attempts' peak memory growth and time."""
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


def _canonical(d: dict) -> bytes:
    return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()


def _seal(d: dict, body: bytes, version: int) -> bytes:
    raw = _canonical(d)
    return PREFIX.pack(b"KVTC", version, 0, len(raw), zlib.crc32(raw)) + raw + body


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


def _split(blob: bytes) -> tuple[dict, int, bytes]:
    _, version, _, hlen, _ = PREFIX.unpack_from(blob, 0)
    return json.loads(blob[PREFIX.size : PREFIX.size + hlen]), version, blob[PREFIX.size + hlen :]


def forged(codec: Codec, blob: bytes, edit) -> bytes:
    """``blob`` with its header changed by ``edit`` and every section an honest zstd stream of zeros of exactly the
    size the changed header implies (the old sections where it implies none that the decoder accepts)."""
    d, version, body = _split(blob)
    edit(d)
    try:
        expected = codec._expected_sections(parse_header(d))
    except (
        FormatError,
        KeyError,
    ):  # the forged fields contradict each other or the calibration: the decoder refuses them whatever the sections
        return _seal(d, body, version)
    frames = {name: _zeros_frame(n) if n else b"" for name, n in expected.items()}
    d["sections"] = [
        [name, "zstd" if f else "raw", expected[name], len(f), zlib.crc32(f)] for name, f in frames.items()
    ]
    return _seal(d, b"".join(frames.values()), version)


# ------------------------------------------------------------------ one real blob of every encode mode
def _fixture_slice(cal: Calibration, tokens: int = 64, seed: int = 0) -> KVSlice:
    lay = cal.layout
    gen = torch.Generator().manual_seed(seed)
    shape = (1, tokens, len(lay.layers), len(lay.heads), lay.head_dim)
    k, v = torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16()
    return KVSlice(lay, k, v, torch.arange(tokens)[None], model_id="fixture")


def _modes() -> dict[str, tuple[Codec, bytes]]:
    plain_cal = Calibration.load(FIX / "calibration.safetensors")
    tiered = tiered_calibration()
    pred_cal = Calibration.load(FIX / "predicted" / "calibration.safetensors")
    emb = load_file(str(FIX / "predicted" / "embeddings.safetensors"))["weight"]
    out = {}
    ident = Codec.identity(backend="zstd")
    out["identity"] = (ident, ident.encode(_fixture_slice(plain_cal)))
    plain = Codec(plain_cal, ratio=8, sinks=2, window=4)
    out["one_plan"] = (plain, plain.encode(_fixture_slice(plain_cal)))
    sliding = Codec(tiered, 8, window=16, tiers="none")  # a sliding-window layer holding fewer tokens: version 2
    out["sliding_one_plan"] = (sliding, sliding.encode(tiered_slice()))
    two = Codec(tiered, 8, window=16, tiers="two")
    out["tiers"] = (two, two.encode(tiered_slice()))
    lad = Codec(tiered, 8, window=16)
    out["ladder"] = (lad, lad.encode(tiered_slice()))
    pred = Codec(pred_cal, ratio=8, sinks=2, window=4, embeddings=emb)
    out["token_map"] = (pred, (FIX / "predicted" / "sample.kvtc").read_bytes())
    return out


MODES = _modes()


def test_every_mode_writes_its_own_container_version_and_decodes():
    want = {"identity": 1, "one_plan": 1, "sliding_one_plan": 2, "tiers": 3, "ladder": 4, "token_map": 5}
    for mode, (codec, blob) in MODES.items():
        h, _ = container.read_header(blob)
        assert h.version == want[mode], mode
        assert codec.decode(blob).num_tokens == h.tokens


def _scale(d: dict, batch: int = 1, tokens: int = 1) -> None:
    d["batch"] *= batch
    d["tokens"] *= tokens
    if d["mode"] == "identity":  # an identity blob stores every token raw: its window covers them all
        d["window"] = d["tokens"] - d["sinks"]
    if d.get("rung_counts"):  # the counts must cover the new middle tokens: all on the coarsest rung
        mid = {}
        for kind, groups in d["rung_counts"].items():
            mid[kind] = [[0] * (len(c) - 1) + [sum(c) * batch * tokens] for c in groups]
        d["rung_counts"] = mid


def _edits(mode: str, codec: Codec) -> dict[str, object]:
    """Name -> edit of a header dict: every field that enters the allowance, forged toward a larger decode."""
    cal = codec.calibration
    top = None if cal is None else max(cal.plans, key=float)
    e: dict[str, object] = {
        "tokens_x4096": lambda d: _scale(d, tokens=4096),
        "batch_x256_tokens_x64": lambda d: _scale(d, batch=256, tokens=64),
        "window_shrunk_tokens_x1024": lambda d: (_scale(d, tokens=1024), d.update(window=0, sinks=0)),
    }
    if mode in ("one_plan", "sliding_one_plan", "token_map"):
        e["ratio_top_tokens_x4096"] = lambda d: (_scale(d, tokens=4096), d.update(ratio=top))
    if mode != "identity":
        e["ratio_1e6_tokens_x4096"] = lambda d: (_scale(d, tokens=4096), d.update(ratio="1e+06"))
    if mode == "tiers":
        e["tiers_top_share_tokens_x4096"] = lambda d: (_scale(d, tokens=4096), d.update(tiers=[top, top, 1e-6]))
    if mode == "ladder":
        e["rungs_top_tokens_x4096"] = lambda d: (_scale(d, tokens=4096), d.update(rungs=sorted(d["rungs"], key=float)))
    if mode == "token_map":
        e["predicted_dropped_tokens_x4096"] = lambda d: (_scale(d, tokens=4096), d.pop("predicted"))
    return e


CASES = [(m, n) for m, (c, _) in MODES.items() for n in _edits(m, c)]


@pytest.mark.parametrize("mode,edit", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_forged_allowance_fields_are_refused_cheaply(mode, edit):
    codec, blob = MODES[mode]
    hostile = forged(codec, blob, _edits(mode, codec)[edit])
    try:
        header, _ = container.read_header(hostile)
    except FormatError:
        return  # refused by the container itself (e.g. a version that does not match the fields)
    assert budget.decoded_bytes(header) >= 1000 * len(hostile), "the forgery should declare a large decode"
    _refused_cheaply(codec, hostile)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_forged_pad_or_section_size_is_refused(mode):
    codec, blob = MODES[mode]
    d, version, body = _split(blob)
    # a pad where none is needed, or larger than any blob needs: refused before reading it
    big = 1 << 20
    zeros = bytes(big)
    d2 = json.loads(json.dumps(d))
    d2["sections"].append([PAD_SECTION, "raw", big, big, zlib.crc32(zeros)])
    _refused_cheaply(codec, _seal(d2, body + zeros, version))
    # a section whose coded bytes exceed its raw bytes (no writer stores such a stream): refused by the container
    d3 = json.loads(json.dumps(d))
    name, backend, raw, coded, crc = d3["sections"][-1]
    d3["sections"][-1] = [name, "zstd", raw, raw + 1, crc]
    with pytest.raises(FormatError, match="coded bytes"):
        container.read_header(_seal(d3, body + b"\0", version))


@pytest.mark.parametrize("mode", ["identity", "one_plan", "sliding_one_plan", "tiers", "ladder"])
def test_an_all_zero_cache_is_padded_and_decodes(mode, monkeypatch):
    """Streams of an all-zero cache shrink thousands of times: the writer pads the blob to within MAX_CODER_GAIN,
    so the decoder, which refuses anything beyond it, still reads everything kvtc writes."""
    codec, blob = MODES[mode]
    kv = _fixture_slice(codec.calibration or Calibration.load(FIX / "calibration.safetensors"), tokens=8192)
    if mode in ("sliding_one_plan", "tiers", "ladder"):
        kv = tiered_slice(batch=2, tokens=2048)
    kv.keys.zero_()
    kv.values.zero_()
    zero = codec.encode(kv)
    h, _ = container.read_header(zero)
    raw, coded = sum(s.raw for s in h.sections), sum(s.coded for s in h.sections)
    assert h.sections[-1].name == PAD_SECTION and raw <= budget.MAX_CODER_GAIN * coded
    out = codec.decode(zero)
    if mode == "identity":
        assert torch.equal(out.keys, kv.keys) and torch.equal(out.values, kv.values)
    # the pad changes nothing else: the same blob without it (read under no allowance) decodes to the same slice
    d, version, body = _split(zero)
    pad = d["sections"].pop()
    unpadded = _seal(d, body[: -pad[3]], version)
    monkeypatch.setattr(budget, "MAX_CODER_GAIN", 1 << 30)
    bare = codec.decode(unpadded)
    assert torch.equal(out.keys, bare.keys) and torch.equal(out.values, bare.values)
    # the honest blob of real (random) KV needs no pad
    assert container.read_header(blob)[0].sections[-1].name != PAD_SECTION


@pytest.mark.parametrize("ratio", [" 8 ", "８", "08", "8.0", "1e-320", "nan", "-8", "1E+06", "8_0", "", "1e+07"])
def test_only_canonical_ratios_are_read(ratio):
    assert not canonical_ratio(ratio)
    codec, blob = MODES["one_plan"]
    d, version, body = _split(blob)
    d["ratio"] = ratio
    with pytest.raises(FormatError, match="ratio"):
        container.read_header(_seal(d, body, version))
    for good in ("8", "2.5", "192", "7.5", "1e+06"):
        assert canonical_ratio(good)


def test_a_header_in_any_other_spelling_is_refused():
    codec, blob = MODES["one_plan"]
    d, version, body = _split(blob)
    assert codec.decode(_seal(d, body, version)).num_tokens == d["tokens"]  # canonical: as written
    for raw in (json.dumps(d).encode(), json.dumps(d, sort_keys=True).encode(), _canonical(d)[:-1] + b" }"):
        spelled = PREFIX.pack(b"KVTC", version, 0, len(raw), zlib.crc32(raw)) + raw + body
        with pytest.raises(FormatError, match="canonical"):
            container.read_header(spelled)
    dup = _canonical(d).replace(b'{"batch":1,', b'{"batch":1,"batch":1,', 1)
    assert dup != _canonical(d)
    with pytest.raises(FormatError, match="canonical"):
        container.read_header(PREFIX.pack(b"KVTC", version, 0, len(dup), zlib.crc32(dup)) + dup + body)


def test_max_decoded_bytes_is_configurable_and_honest_blobs_decode():
    codec, blob = MODES["one_plan"]
    need = budget.decoded_bytes(container.read_header(blob)[0])
    cal = codec.calibration
    assert Codec(cal, ratio=8, max_decoded_bytes=need).decode(blob).num_tokens == 64
    with pytest.raises(FormatError, match="max_decoded_bytes"):
        Codec(cal, ratio=8, max_decoded_bytes=need - 1).decode(blob)


def test_a_blob_of_another_calibration_is_refused_before_its_sizes_count():
    codec, blob = MODES["ladder"]
    with pytest.raises(CalibrationMismatch):
        Codec(Calibration.load(FIX / "calibration.safetensors"), ratio=8).decode(blob)
