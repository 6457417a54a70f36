"""Codec round trips on synthetic KV with a known spectrum in a random rotation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtc import KVLayout, KVSlice, PCAGrouping
from kvtc.calibration import Recipe, fit_calibration
from kvtc.calibration.artifact import ratio_key
from kvtc.calibration.dp import PAPER_TYPES, Plan
from kvtc.codec import Codec
from kvtc.codec.codec import CODED_TYPES
from kvtc.coding.packing import packed_plane_bytes
from kvtc.errors import CalibrationError, CalibrationMismatch, LayoutError
from kvtc.quant import (
    CLIPS,
    DROP,
    FP8,
    INT2,
    INT2S,
    TYPE_BITS,
    TYPE_NAMES,
    best_clips,
    clippable,
    fixed_step,
    param_rows,
    quantize,
    squared_error,
)
from reference import roundtrip
from synthetic import LowRankSource, make_slice, rel_err

RATIOS = (2, 4, 8, 16, 32, 64)


@pytest.fixture(scope="module")
def setup():
    layout = KVLayout(layers=(0, 2, 5, 7), num_kv_heads=4, head_dim=32, dtype="float32")
    p = layout.num_features  # 512
    ks = LowRankSource(p, decay=1e-3, noise=1e-3, seed=10)
    vs = LowRankSource(p, decay=1e-2, noise=1e-3, seed=20)
    kc = [ks.rows(1024) for _ in range(6)]
    vc = [vs.rows(1024) for _ in range(6)]
    cal = fit_calibration(layout, list(zip(kc, vc)), Recipe(ratios=RATIOS, dp_rows=1024))
    return layout, ks, vs, cal


def test_error_falls_with_ratio_reaches_fp8_floor_and_matches_float64_reference(setup):
    layout, ks, vs, cal = setup
    krows, vrows = ks.rows(600), vs.rows(600)
    kv = make_slice(layout, krows, vrows)
    errors = []
    for r in sorted(RATIOS, reverse=True):
        codec = Codec(cal, ratio=r, sinks=0, window=0)
        out = codec.decode(codec.encode(kv))
        errs = []
        for kind, rows, rec in (("keys", krows, out.keys), ("values", vrows, out.values)):
            rec = rec.reshape(600, -1).double()
            e = rel_err(rec, rows)
            errs.append(e)
            pca = cal.pcas[kind][0]
            ref = roundtrip(rows, pca.mean, pca.basis, cal.plan(r, kind, 0))
            ref_err = float((ref - rows.double()).square().sum())
            # same plan, same reconstruction up to float32 rounding (a handful of symbols may round the other way)
            assert float((rec - ref).square().sum()) <= 1e-2 * ref_err + 1e-9 * float(rows.double().square().sum())
            assert e == pytest.approx(ref_err / float(rows.double().square().sum()), rel=0.02)
        errors.append(max(errs))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] <= 2e-3  # ratio 2: the fp8 floor


@pytest.mark.parametrize("qtype", CODED_TYPES)
def test_every_type_matches_the_float64_reference_and_counts_its_params(setup, qtype):
    # a hand-made plan of one type (groups of 1, 16 and 64 components): the codec's reconstruction equals the
    # independent reference's, and the params stream holds exactly the rows the type needs
    layout, ks, vs, cal = setup
    # scale-only int groups of more than one component carry encoder clips (0.625 and 0.4375 here)
    clips = tuple([1.0] * 3 + ([0.625, 0.4375, 0.625] if clippable(qtype, 16) else [1.0] * 3))
    if fixed_step(qtype):  # a fixed-step group's value is its step: fine to coarse against the keys' spread
        pca = cal.pcas["keys"][0]
        sd = ((ks.rows(300) - pca.mean) @ pca.basis.float().T).std(0)
        starts = (0, 1, 2, 3, 19, 48)
        clips = tuple(float(sd[c]) * f for c, f in zip(starts, (0.05, 0.3, 1.0, 0.1, 0.5, 2.0)))
    plan = Plan(
        ((1, qtype, 3), (16, qtype, 2), (1, DROP, 13), (64, qtype, 1)),
        clips=clips if any(c != 1.0 for c in clips) else (),
    )
    # named ratio 8 (16 for the fixed-step types, whose coarse groups code to almost nothing): the blob-size sanity
    # bound scales with the named ratio, and int1s codes ~80x here
    named = 16 if fixed_step(qtype) else 8
    hand = dataclasses.replace(cal, plans={ratio_key(named): {"keys": [plan], "values": [plan]}})
    krows, vrows = ks.rows(300), vs.rows(300)
    kv = make_slice(layout, krows, vrows)
    codec = Codec(hand, ratio=named, sinks=0, window=0)
    blob = codec.encode(kv)
    out = codec.decode(blob)
    sections = {sec["name"]: sec["raw"] for sec in Codec.inspect(blob)["sections"]}
    assert sections["keys.0.params"] == 6 * param_rows(qtype) * 300 * 2
    assert sections[f"keys.0.{TYPE_NAMES[qtype]}"] == 99 * packed_plane_bytes(300, TYPE_BITS[qtype], "bits")
    for kind, rows, rec in (("keys", krows, out.keys), ("values", vrows, out.values)):
        pca = cal.pcas[kind][0]
        ref = roundtrip(rows, pca.mean, pca.basis, plan)
        rec = rec.reshape(300, -1).double()
        ref_err = float((ref - rows.double()).square().sum())
        assert float((rec - ref).square().sum()) <= 1e-2 * ref_err + 1e-9 * float(rows.double().square().sum())


def test_rank_reduced_basis_works_through_every_path(setup):
    layout, ks, vs, cal = setup
    for kind in ("keys", "values"):
        k = cal.pcas[kind][0].basis.shape[0]
        assert cal.pcas[kind][0].basis.shape == (k, layout.num_features)
    # trailing components are dropped at 64x: the basis was cut to what the plans keep, and the 64x plan
    # keeps far fewer rows than the basis has
    kb = cal.pcas["keys"][0].basis.shape[0]
    assert kb < layout.num_features
    assert cal.plan(64, "keys", 0).kept_components < kb
    kv = make_slice(layout, ks.rows(300), vs.rows(300), batch=3)
    codec = Codec(cal, ratio=64, sinks=4, window=16)
    blob = codec.encode(kv)
    out = codec.decode(blob)
    assert out.keys.shape == kv.keys.shape and out.values.shape == kv.values.shape
    assert torch.equal(out.positions, kv.positions)
    assert torch.equal(out.keys[:, :4], kv.keys[:, :4]) and torch.equal(out.values[:, -16:], kv.values[:, -16:])
    layers = list(codec.decode_layers(blob))
    assert [layer for layer, _, _ in layers] == list(layout.layers)
    assert torch.allclose(torch.stack([k for _, k, _ in layers], 2), out.keys, atol=1e-4)
    assert torch.allclose(torch.stack([v for _, _, v in layers], 2), out.values, atol=1e-4)
    # a saved and reloaded calibration gives the same bytes
    again = Codec(type(cal).from_bytes(cal.to_bytes()), ratio=64, sinks=4, window=16)
    assert again.encode(kv) == blob


@pytest.mark.parametrize("types", ["paper", "default"])
def test_stored_ratio_meets_its_target_within_12_percent(types):
    """Each plan's budget counts the bytes its sections store, entropy coded as in a blob (the stored rate): a blob
    of the middle tokens stores at least its target ratio and not far above it."""
    layout = KVLayout(layers=tuple(range(8)), num_kv_heads=3, head_dim=64)  # SmolLM2 heads, 8 layers, bf16
    p = layout.num_features
    src = LowRankSource(p, decay=1e-3, noise=1e-3, seed=5)
    rows = [src.rows(1024) for _ in range(2)]
    kw = {"types": PAPER_TYPES} if types == "paper" else {}
    recipe = Recipe(ratios=(8, 16, 32), dp_rows=512, **kw)
    cal = fit_calibration(layout, list(zip(rows, rows)), recipe)
    kv = make_slice(layout, src.rows(2048), src.rows(2048))
    for r in (8, 16, 32):
        info = Codec.inspect(Codec(cal, ratio=r).encode(kv))
        int3 = sum(
            sec["raw"] for sec in info["sections"] if sec["name"].endswith(".int3") or sec["name"].endswith(".int3s")
        )
        if types == "paper":
            assert int3 == 0
        else:
            assert cal.extended_types
        assert 0.97 * r <= info["codec_ratio"] <= 1.12 * r, (r, info["codec_ratio"])
        assert info["codec_ratio"] >= info["codec_ratio_before_entropy"]  # the entropy coder never loses
        assert info["bytes_per_middle_token"] > 0
        assert info["whole_cache_ratio"] < info["codec_ratio"]  # sinks and window are stored raw
        assert info["middle_tokens"] == 2048 - 4 - 128


@pytest.mark.parametrize(
    "grouping", [PCAGrouping("layers", 2), PCAGrouping("layers", 1), PCAGrouping("head_shards", 2)]
)
def test_pca_groupings_round_trip(grouping):
    layout = KVLayout(layers=(1, 3, 4), num_kv_heads=4, head_dim=8, dtype="float32")
    p = layout.num_features
    src = LowRankSource(p, decay=1e-2, noise=1e-3, seed=7)
    rows = [src.rows(512) for _ in range(3)]
    cal = fit_calibration(layout, list(zip(rows, rows)), Recipe(ratios=(2, 8), grouping=grouping, dp_rows=256))
    assert len(cal.pcas["keys"]) == len(grouping.groups(layout))
    x = src.rows(200)
    kv = make_slice(layout, x, x)
    codec = Codec(cal, ratio=2, sinks=0, window=0)
    out = codec.decode(codec.encode(kv))
    assert rel_err(out.keys, kv.keys) < 2e-3
    layers = list(codec.decode_layers(codec.encode(kv)))
    assert torch.allclose(torch.stack([k for _, k, _ in layers], 2), out.keys, atol=1e-4)


def test_head_shard_calibration_encodes_a_tensor_parallel_rank():
    layout = KVLayout(layers=(0, 1), num_kv_heads=4, head_dim=8, dtype="float32")
    src = LowRankSource(layout.num_features, decay=1e-2, noise=1e-3, seed=8)
    rows = [src.rows(512) for _ in range(3)]
    cal = fit_calibration(
        layout, list(zip(rows, rows)), Recipe(ratios=(4,), grouping=PCAGrouping("head_shards", 2), dp_rows=256)
    )
    rank1 = cal.shard((2, 3))
    assert rank1.layout.heads == (2, 3)
    full = src.rows(100).reshape(1, 100, 2, 4, 8)
    part = full[:, :, :, 2:4].reshape(100, -1)
    kv = make_slice(rank1.layout, part, part)
    codec = Codec(rank1, ratio=4, sinks=0, window=0)
    out = codec.decode(codec.encode(kv))
    assert rel_err(out.keys, kv.keys) < 0.05
    with pytest.raises(CalibrationMismatch):
        cal.shard((1, 2))  # cuts across the PCA groups
    glob = fit_calibration(layout, list(zip(rows, rows)), Recipe(ratios=(4,), dp_rows=256))
    with pytest.raises(CalibrationMismatch):
        glob.shard((0, 1))


def test_identity_codec_is_lossless_and_needs_no_calibration(setup):
    layout, ks, vs, cal = setup
    kv = make_slice(layout, ks.rows(64), vs.rows(64), batch=2, start=100)
    blob = Codec.identity(backend="zstd").encode(kv)
    out = Codec.identity().decode(blob)
    assert torch.equal(out.keys, kv.keys) and torch.equal(out.values, kv.values)
    assert torch.equal(out.positions, kv.positions)
    # a kvtc codec decodes identity blobs too (they name no calibration)
    assert torch.equal(Codec(cal, ratio=8).decode(blob).keys, kv.keys)
    assert Codec.inspect(blob)["mode"] == "identity"


def test_wrong_inputs_are_refused_with_typed_errors(setup):
    layout, ks, vs, cal = setup
    with pytest.raises(CalibrationError, match="no bit plan for ratio 12"):
        Codec(cal, ratio=12)
    other = KVLayout(layers=(0, 2, 5, 8), num_kv_heads=4, head_dim=32, dtype="float32")
    x = ks.rows(10)
    with pytest.raises(CalibrationMismatch):
        Codec(cal, ratio=8).encode(make_slice(other, x, x))
    bad = x.reshape(1, 10, 4, 4, 32)[..., :-1].contiguous()
    with pytest.raises(LayoutError):
        KVSlice(layout, bad, bad, torch.arange(10)[None])


def test_empty_batch_and_short_sequences_round_trip(setup):
    layout, ks, vs, cal = setup
    codec = Codec(cal, ratio=8, sinks=4, window=16)
    empty = KVSlice(
        layout, torch.zeros(0, 50, 4, 4, 32), torch.zeros(0, 50, 4, 4, 32), torch.zeros(0, 50, dtype=torch.int64)
    )
    out = codec.decode(codec.encode(empty))
    assert out.keys.shape == (0, 50, 4, 4, 32)
    short = make_slice(layout, ks.rows(10), vs.rows(10))  # fewer tokens than sinks + window: all raw
    out = codec.decode(codec.encode(short))
    assert torch.equal(out.keys, short.keys) and Codec.inspect(codec.encode(short))["middle_tokens"] == 0


def test_encode_into_a_caller_buffer(setup):
    """encode(out=...) writes the same bytes into the caller's memory and returns a view decode accepts; a buffer
    too small, read-only or of the wrong kind is refused before anything is written."""
    from kvtc.errors import OutputBufferError

    layout, ks, vs, cal = setup
    kv = make_slice(layout, ks.rows(2 * 300), vs.rows(2 * 300), batch=2)
    codec = Codec(cal, ratio=16)
    want = codec.encode(kv)
    ref = codec.decode(want)
    buf = bytearray(b"\x5a" * (len(want) + 100))
    got = codec.encode(kv, out=buf)
    assert isinstance(got, memoryview) and len(got) == len(want) and bytes(got) == want
    assert bytes(buf[len(want) :]) == b"\x5a" * 100
    t = torch.zeros(len(want) + 7, dtype=torch.uint8)
    tv = codec.encode(kv, out=t)
    assert isinstance(tv, torch.Tensor) and tv.numel() == len(want) and tv.numpy().tobytes() == want
    for blob in (got, tv):
        out = codec.decode(blob)
        assert torch.equal(out.keys, ref.keys) and torch.equal(out.values, ref.values)
        assert Codec.inspect(blob)["bytes"] == len(want)
    small = bytearray(b"\xab" * (len(want) - 1))
    with pytest.raises(OutputBufferError) as e:
        codec.encode(kv, out=small)
    assert e.value.needed == len(want) and small == bytearray(b"\xab" * (len(want) - 1))
    with pytest.raises(OutputBufferError, match="read-only"):
        codec.encode(kv, out=bytes(len(want)))
    for dtype in (torch.float32, torch.int8):
        with pytest.raises(OutputBufferError, match="uint8"):
            codec.encode(kv, out=torch.zeros(len(want), dtype=dtype))


def test_write_into_copies_large_parts_in_pieces():
    """Parts larger than a copy piece (several MiB, copied on host threads) land byte for byte, back to back."""
    import numpy as np

    from kvtc.codec import container

    g = np.random.default_rng(0)
    parts = [g.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (3, container.PIECE + 5, 1, 2 * container.PIECE)]
    parts[1] = memoryview(parts[1])
    out = np.zeros(sum(len(p) for p in parts) + 3, dtype=np.uint8)
    view = container.write_into(out, parts)
    assert bytes(view) == b"".join(bytes(p) for p in parts)
    assert not out[-3:].any()


def test_clipping_lowers_the_error_of_wide_scale_only_groups_and_is_refused_elsewhere():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, 64, generator=g)
    clips, errs = best_clips(x, INT2S)
    plain = squared_error(x, INT2S)
    assert set(clips.tolist()) <= set(CLIPS) and bool((clips < 1).all())
    assert float(errs.sum()) < 0.8 * float(plain.sum())  # Gaussian groups of 64 at 2 bits: clipping pays
    assert torch.allclose(errs, squared_error(x, INT2S, clips))
    # a one-component group stores its value (clip 1); min/max and fp8 types never clip
    assert bool((best_clips(x[:, :, :1], INT2S)[0] == 1).all())
    for t in (INT2, FP8):
        assert bool((best_clips(x, t)[0] == 1).all())
        with pytest.raises(ValueError):
            quantize(x, t, 0.5)
    with pytest.raises(ValueError):
        quantize(x, INT2S, 1.5)


def test_plan_clips_round_trip_and_bad_clips_are_refused():
    plan = Plan(((16, INT2S, 1), (16, DROP, 1), (16, INT2, 1), (1, INT2S, 2)), clips=(0.5, 1.0, 1.0, 1.0))
    assert Plan.from_dict(plan.to_dict(), 64) == plan
    assert "clips" not in Plan(((16, INT2, 1),)).to_dict()  # plans without clips are written as before
    # too few; a clipped min/max group; a clipped one-component group; above 1; zero
    for bad in (
        (0.5, 1.0, 1.0),
        (0.5, 0.5, 1.0, 1.0),
        (0.5, 1.0, 0.5, 1.0),
        (1.5, 1.0, 1.0, 1.0),
        (0.0, 1.0, 1.0, 1.0),
    ):
        d = dict(plan.to_dict(), clips=list(bad))
        with pytest.raises(CalibrationError, match="clips"):
            Plan.from_dict(d, 64)
