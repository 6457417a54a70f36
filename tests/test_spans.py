"""Layers that hold different tokens (sliding-window + full attention): layout, grouping, codec, container v2.

Synthetic low-rank KV in a layout shaped like Gemma 3 (sliding layers holding their newest tokens, full layers
holding all), coded by a calibration fitted on it: what each layer does not hold is neither stored nor returned,
what it holds comes back within the plan's error, and a slice whose layers all hold every token is written
exactly as before (container version 1).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtc import KVLayout, KVSlice, PCAGrouping
from kvtc.calibration import Recipe, fit_calibration
from kvtc.calibration.meta import _groups
from kvtc.codec import Codec, container
from kvtc.errors import FormatError, LayoutError
from synthetic import LowRankSource, rel_err

#: 6 layers, 1 KV head of 16: layers 0, 1, 3, 4 slide (hold their newest 24 tokens), 2 and 5 attend to all
LIMITS = (24, 24, 0, 24, 24, 0)
LAYOUT = KVLayout(layers=tuple(range(6)), num_kv_heads=1, head_dim=16, dtype="float32", max_tokens=LIMITS)
SLIDING, FULL = [0, 1, 3, 4], [2, 5]
T = 80


def windowed_slice(batch: int = 2, tokens: int = T, seed: int = 3) -> KVSlice:
    src = {kind: LowRankSource(LAYOUT.num_features, rank=24, seed=seed + i) for i, kind in enumerate("kv")}
    keys = src["k"].rows(batch * tokens).reshape(batch, tokens, 6, 1, 16)
    values = src["v"].rows(batch * tokens).reshape(batch, tokens, 6, 1, 16)
    for t in (keys, values):
        t[:, : tokens - 24, SLIDING] = 0  # what a sliding layer does not hold
    pos = torch.arange(tokens).repeat(batch, 1)
    return KVSlice(LAYOUT, keys, values, pos)


@pytest.fixture(scope="module")
def calibration():
    src = {kind: LowRankSource(LAYOUT.num_features, rank=24, seed=3 + i) for i, kind in enumerate("kv")}
    rows = [(src["k"].rows(4000), src["v"].rows(4000))]
    return fit_calibration(LAYOUT, rows, Recipe(ratios=(4, 8), sensitivity="none", tokens=4000, dp_rows=4000))


def test_spans_and_protected_tokens():
    spans = LAYOUT.spans
    assert [(sp.limit, sp.indices) for sp in spans] == [(24, (0, 1, 3, 4)), (0, (2, 5))]
    sliding, full = spans
    assert sliding.protected(T, 4, 8) == (56, 0, 8)  # holds tokens 56..79: no sink, 8 recent raw, 16 coded
    assert full.protected(T, 4, 8) == (0, 4, 8)
    assert sliding.protected(20, 4, 8) == (0, 4, 8)  # a short sequence: every token is held
    assert sliding.protected(26, 4, 8) == (2, 2, 8)  # tokens 2..25 held: sinks 2 and 3 still raw
    assert KVLayout(layers=(0, 1), num_kv_heads=1, head_dim=4, max_tokens=(0, 0)).max_tokens == ()
    with pytest.raises(LayoutError, match="max_tokens"):
        KVLayout(layers=(0, 1), num_kv_heads=1, head_dim=4, max_tokens=(3,))


def test_groupings_never_mix_layers_that_hold_different_tokens():
    glob = PCAGrouping().groups(LAYOUT)
    assert [[layer for layer, _ in g] for g in glob] == [SLIDING, FULL]
    layers2 = PCAGrouping("layers", 2).groups(LAYOUT)
    assert [[layer for layer, _ in g] for g in layers2] == [[0, 1], [2], [3, 4], [5]]
    dense = dataclasses.replace(LAYOUT, max_tokens=())
    assert [len(g) for g in PCAGrouping("layers", 4).groups(dense)] == [4, 2]  # unchanged without windows


@settings(max_examples=60, deadline=None)
@given(
    limits=st.lists(st.sampled_from([0, 5, 9]), min_size=1, max_size=12),
    heads=st.sampled_from([1, 2, 4]),
    kind=st.sampled_from(PCAGrouping.KINDS),
    size=st.integers(1, 4),
)
def test_metadata_group_count_matches_the_grouping(limits, heads, kind, size):
    """The calibration parser counts groups without building them; it must agree with the grouping itself."""
    layout = KVLayout(layers=tuple(range(len(limits))), num_kv_heads=heads, head_dim=2, max_tokens=tuple(limits))
    grouping = PCAGrouping(kind, size)
    if kind == "head_shards" and heads % size:
        return
    groups = grouping.groups(layout)
    assert _groups(grouping.to_dict(), list(limits), heads, 2, "x") == (len(groups), 2 * max(map(len, groups)))


def test_codec_stores_only_held_tokens_and_returns_zeros_elsewhere(calibration):
    kv = windowed_slice()
    codec = Codec(calibration, 8, sinks=4, window=8)
    blob = codec.encode(kv)
    info = Codec.inspect(blob)
    assert info["version"] == 2 and blob[4:6] == struct.pack("<H", 2)
    assert [(s["held"], s["sinks"], s["window"], s["coded"]) for s in info["spans"]] == [(24, 0, 8, 16), (80, 4, 8, 68)]
    sec = {s["name"]: s["raw"] for s in info["sections"]}
    assert sec["raw.keys"] == 2 * 16 * 4 * (8 * 4 + 12 * 2)  # batch 2, 16 floats of 4 bytes, per span (s+w) x layers
    # group 0 (sliding) codes 2 x 16 rows, group 1 (full) 2 x 68: its range parameters say so (fp16 rows)
    params = {name: raw for name, raw in sec.items() if name.endswith(".params")}
    assert params["keys.0.params"] % (2 * 2 * 16) == 0 and params["keys.1.params"] % (2 * 2 * 68) == 0
    out = codec.decode(blob)
    for t_out, t_in in ((out.keys, kv.keys), (out.values, kv.values)):
        assert not t_out[:, :56, SLIDING].any()  # not held: zero, never stored
        assert torch.equal(t_out[:, -8:], t_in[:, -8:])  # recent window exact in every layer
        assert torch.equal(t_out[:, :4, FULL], t_in[:, :4, FULL])  # sinks exact where held
        assert rel_err(t_out[:, 56:72, SLIDING], t_in[:, 56:72, SLIDING]) < 0.05
        assert rel_err(t_out[:, 4:72, FULL], t_in[:, 4:72, FULL]) < 0.05
    layers = list(codec.decode_layers(blob))
    for i, (layer, k, v) in enumerate(layers):
        assert layer == i and torch.equal(k, out.keys[:, :, i]) and torch.equal(v, out.values[:, :, i])


def test_identity_round_trip_is_exact_and_counts_held_bytes():
    kv = windowed_slice(batch=1)
    blob = Codec.identity().encode(kv)
    info = Codec.inspect(blob)
    assert info["original_bytes"] == 2 * 4 * 16 * (24 * 4 + 80 * 2)
    out = Codec.identity().decode(blob)
    assert torch.equal(out.keys, kv.keys) and torch.equal(out.values, kv.values)


def test_dense_layouts_still_write_version_1_byte_for_byte(calibration):
    dense = KVLayout(layers=(0, 1), num_kv_heads=1, head_dim=4, dtype="float32")
    kv = KVSlice(dense, torch.randn(1, 10, 2, 1, 4), torch.randn(1, 10, 2, 1, 4), torch.arange(10)[None])
    blob = Codec.identity().encode(kv)
    assert blob[4:6] == struct.pack("<H", 1) and b"max_tokens" not in blob


def _reseal(blob: bytes, version: int | None = None, edit=None) -> bytes:
    _, v, flags, hlen, _ = container.PREFIX.unpack_from(blob, 0)
    header = json.loads(blob[16 : 16 + hlen])
    if edit:
        edit(header)
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    prefix = container.PREFIX.pack(b"KVTC", v if version is None else version, flags, len(raw), zlib.crc32(raw))
    return prefix + raw + blob[16 + hlen :]


def test_version_and_layout_must_agree(calibration):
    blob = bytes(Codec.identity().encode(windowed_slice(batch=1)))
    with pytest.raises(FormatError, match="version 1 with a layout that has"):
        Codec.identity().decode(_reseal(blob, version=1))
    with pytest.raises(FormatError, match="without token-adaptive tiers"):
        Codec.identity().decode(_reseal(blob, version=3))
    with pytest.raises(FormatError, match="not supported"):
        Codec.identity().decode(_reseal(blob, version=max(container.VERSIONS) + 1))

    def bad_limits(h):
        h["layout"]["max_tokens"] = [24, 24, -1, 24, 24, 0]

    with pytest.raises(FormatError, match="max_tokens"):
        Codec.identity().decode(_reseal(blob, edit=bad_limits))


def test_a_slice_mostly_outside_its_windows_is_refused():
    lay = KVLayout(layers=(0, 1), num_kv_heads=1, head_dim=4, dtype="float32", max_tokens=(1, 1))
    kv = KVSlice(lay, torch.zeros(1, 200, 2, 1, 4), torch.zeros(1, 200, 2, 1, 4), torch.arange(200)[None])
    with pytest.raises(LayoutError, match="hold under 1/64"):
        Codec.identity().encode(kv)


def test_calibration_of_a_windowed_model_is_refused_for_a_dense_one(calibration):
    dense = dataclasses.replace(LAYOUT, max_tokens=())
    kv = windowed_slice()
    kv = KVSlice(dense, kv.keys, kv.values, kv.positions)
    with pytest.raises(Exception, match="another model"):
        Codec(calibration, 8).encode(kv)
