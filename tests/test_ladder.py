"""The rate ladder (container version 4): the allocator against brute force, the round trip (each token exactly as
its rung's own plan codes it), the bytes it stores, the rungs a target chooses among, and damaged ladders refused."""

from __future__ import annotations

import itertools
import struct

import pytest
import torch

from kvtc.codec import Codec, container, tiers
from kvtc.errors import FormatError
from test_tiers import LAYOUT, _rewrite, container_middles, tiered_calibration, tiered_slice


@pytest.fixture(scope="module")
def cal():
    return tiered_calibration()


#: a cost per rung (one kind and group), or per row and rung (keys and values of a group at one price: each kind
#: splits a plan's bytes its own way)
PER_RUNG = torch.tensor([1 / 4, 1 / 8, 1 / 16], dtype=torch.float64)
PER_ROW = torch.tensor([[1 / 4, 1 / 8, 1 / 16]] * 3 + [[1 / 2, 1 / 5, 1 / 12]] * 3, dtype=torch.float64)


@pytest.mark.parametrize("costs", [PER_RUNG, PER_ROW], ids=["per-rung", "per-row"])
@pytest.mark.parametrize("seed", range(6))
def test_allocate_is_optimal_for_what_it_spends_and_keeps_to_the_budget(seed, costs):
    gen = torch.Generator().manual_seed(seed)
    n, r = 6, 3
    rows = torch.arange(n)
    per_row = costs.expand(n, r)
    # errors fall as a token spends more, by a random amount per token
    errors = torch.rand(n, 1, generator=gen, dtype=torch.float64) * torch.tensor([[0.2, 1.0, 3.0]])
    errors = errors * torch.rand(n, r, generator=gen, dtype=torch.float64).add(0.5)
    floor = float(per_row.min(1).values.sum())  # the cheapest rung everywhere: what any choice spends at least
    for budget in (n / 16, n / 10, n / 6, n / 4, n / 3):
        pick = tiers.allocate(errors, costs, budget)
        spent = float(per_row[rows, pick].sum())
        assert spent <= max(budget, floor) + 1e-12
        got = float(errors[rows, pick].sum())
        best = min(
            float(errors[rows, torch.tensor(a)].sum())
            for a in itertools.product(range(r), repeat=n)
            if float(per_row[rows, torch.tensor(a)].sum()) <= spent + 1e-12
        )
        assert got <= best + 1e-12, (budget, got, best)  # nothing that spends as little does better
    # a budget below the cheapest rung everywhere: the cheapest rung everywhere
    assert tiers.allocate(errors, costs, 0.0).tolist() == [2] * n
    assert tiers.allocate(errors[:0], costs[:0] if costs.dim() == 2 else costs, 1.0).numel() == 0


def test_the_rungs_a_target_chooses_among():
    from types import SimpleNamespace

    ladder = (4, 6, 7, 7.5, 8, 10, 12, 16, 18, 24, 32, 36, 48, 64, 72, 96, 144, 192)
    c = SimpleNamespace(plans={str(r): None for r in ladder}, queries=torch.zeros(1))
    assert tiers.ladder_rungs(c, 64) == ("8", "10", "12", "16", "24", "32", "48", "64", "96", "144", "192")
    assert tiers.ladder_rungs(c, 16) == ("4", "6", "7.5", "10", "12", "16", "24", "32", "48", "64", "96")
    assert tiers.ladder_rungs(c, 192) is None  # nothing coarser than the target: one plan
    assert tiers.ladder_rungs(SimpleNamespace(plans=c.plans, queries=None), 16) is None  # no queries


def test_kind_cost_splits_a_plans_bytes_as_the_calibration_did():
    from types import SimpleNamespace

    c = SimpleNamespace(stats={"kv_split": {"value_share": {"16": [0.75, 0.6]}}})
    assert tiers.kind_cost(c, 16, "values", 0) == pytest.approx(2 * 0.75 / 16)
    assert tiers.kind_cost(c, 16, "keys", 1) == pytest.approx(2 * 0.4 / 16)
    for stats in ({}, {"kv_split": {"value_share": {"16": ["x"]}}}, {"kv_split": {"value_share": {"16": [1.5]}}}):
        assert tiers.kind_cost(SimpleNamespace(stats=stats), 16, "keys", 0) == pytest.approx(1 / 16)


def test_ladder_blob_codes_each_token_as_its_rungs_own_plan(cal):
    kv = tiered_slice()
    codec = Codec(cal, 8, window=16)
    assert codec.ladder == ("4", "8", "12") and codec.tiers is None
    blob = codec.encode(kv)
    info = Codec.inspect(blob)
    assert info["version"] == 4 and blob[4:6] == struct.pack("<H", 4)
    assert info["rungs"]["ratios"] == ["4", "8", "12"]
    out = codec.decode(blob)
    assert torch.equal(Codec(cal, 12, tiers="none").decode(blob).keys, out.keys)  # any codec of it decodes it
    plain = {r: Codec(cal, float(r), window=16, tiers="none") for r in codec.ladder}
    plain = {r: c.decode(c.encode(kv)) for r, c in plain.items()}
    _, secs = codec._open(blob)
    used = set()
    for g, (start, m) in enumerate(container_middles(blob, cal)):
        cols = cal.columns[g]
        for kind in ("keys", "values"):
            idx = secs[f"rungs.{kind}.{g}"].view(kv.batch, m)
            assert torch.bincount(idx.reshape(-1), minlength=3).tolist() == info["rungs"]["counts"][kind][g]
            got = getattr(out, kind)[:, start : start + m].flatten(2)[:, :, cols]
            for j, r in enumerate(codec.ladder):
                want = getattr(plain[r], kind)[:, start : start + m].flatten(2)[:, :, cols]
                sel = idx == j
                used.add(j) if bool(sel.any()) else None
                # the same coefficients; the reconstruction's product over fewer rows may round differently
                assert torch.allclose(got[sel], want[sel], rtol=0, atol=1e-5 * float(want.abs().max())), (kind, g, r)
    assert len(used) >= 2  # the ladder did choose between plans
    for li, k, v in codec.decode_layers(blob):
        i = LAYOUT.layers.index(li)
        assert torch.allclose(k, out.keys[:, :, i], atol=1e-5) and torch.allclose(v, out.values[:, :, i], atol=1e-5)


def test_ladder_blob_stores_what_the_plain_target_stores(cal):
    kv = tiered_slice(batch=2, tokens=400)
    ladder = Codec.inspect(Codec(cal, 8, window=16).encode(kv))
    plain = Codec.inspect(Codec(cal, 8, window=16, tiers="none").encode(kv))
    # the rows' budget is the target's, measured after entropy coding; the header and rung indices come on top
    assert ladder["coded_bytes"] <= 1.06 * plain["coded_bytes"], (ladder["coded_bytes"], plain["coded_bytes"])
    assert ladder["coded_bytes"] >= 0.8 * plain["coded_bytes"]


def test_damaged_ladders_are_refused(cal):
    codec = Codec(cal, 8, backend="raw", window=16)
    blob = bytes(codec.encode(tiered_slice()))

    def rw(edit):
        return _rewrite(blob, edit, version=4)

    codec.decode(rw(lambda d, b: None))  # the rewrite alone keeps it valid

    def section(d, name):
        return [s[0] for s in d["sections"]].index(name)

    def bad_index(d, b):
        b[section(d, "rungs.keys.0")][0] = 7

    with pytest.raises(FormatError, match="rung index"):
        codec.decode(rw(bad_index))

    def recount(d, b):
        c = d["rung_counts"]["keys"][0]
        j = next(k for k in range(3) if c[k])
        c[j] -= 1
        c[(j + 1) % 3] += 1

    with pytest.raises(FormatError, match="rung counts|section"):
        codec.decode(rw(recount))

    def short(d, b):
        d["rung_counts"]["values"][0][0] += 1

    with pytest.raises(FormatError, match="sum to"):
        codec.decode(rw(short))
    for field, bad in (("rungs", ["4"]), ("rungs", ["4", "4", "12"]), ("rungs", [4, 8, 12]), ("rung_counts", {}),
                       ("rung_counts", {"keys": [[1, 2]], "values": [[1, 2]]}), ("rung_counts", [1])):  # fmt: skip
        with pytest.raises(FormatError, match="rate ladder"):
            codec.decode(rw(lambda d, b, f=field, v=bad: d.__setitem__(f, v)))
    with pytest.raises(FormatError, match="no plan"):
        codec.decode(rw(lambda d, b: d.__setitem__("rungs", ["4", "8", "13"])))
    with pytest.raises(FormatError, match="both tiers and a rate ladder"):
        codec.decode(rw(lambda d, b: d.__setitem__("tiers", ["4", "12", 0.25])))
    with pytest.raises(FormatError, match="version 3"):  # version 3 cannot carry a ladder, nor 4 lack one
        codec.decode(blob[:4] + struct.pack("<H", 3) + blob[6:])
    two = bytes(Codec(cal, 8, backend="raw", window=16, tiers="two").encode(tiered_slice()))
    with pytest.raises(FormatError):
        codec.decode(two[:4] + struct.pack("<H", 4) + two[6:])
    assert container.VERSION == 5 and {3, 4} <= set(container.VERSIONS)
    with pytest.raises(FormatError, match="token ids"):  # version 5 is the one that carries them
        codec.decode(blob[:4] + struct.pack("<H", 5) + blob[6:])


def test_a_slice_whose_group_codes_no_token_still_round_trips(cal):
    kv = tiered_slice()  # the sliding layer holds 60 tokens: all of them in a window of 70
    codec = Codec(cal, 8, window=70)
    blob = codec.encode(kv)
    counts = Codec.inspect(blob)["rungs"]["counts"]
    middles = container_middles(blob, cal)
    assert sorted(m for _, m in middles) == [0, 126]
    for kind in ("keys", "values"):
        assert [sum(c) for c in counts[kind]] == [kv.batch * m for _, m in middles]
    out = codec.decode(blob)
    for t in (0, 30, 199):  # sinks, coded middle and window tokens come back in their places
        assert torch.allclose(out.keys[:, t], kv.keys[:, t], atol=0.5 * float(kv.keys.abs().max()))


def test_ladder_weights_are_relative_squared_attention_per_layer():
    mass = torch.tensor([[[1.0, 3.0], [2.0, 2.0]]])  # [B=1, Lg=2, m=2]
    w = tiers.ladder_weights(mass, power=2.0)
    assert w.shape == (2, 2)
    assert torch.allclose(w, torch.tensor([[0.25, 1.0], [2.25, 1.0]]))
    zero = tiers.ladder_weights(torch.zeros(1, 1, 3))
    assert bool(torch.isfinite(zero).all())


def test_one_price_compares_each_kinds_error_over_its_energy():
    from types import SimpleNamespace

    pca = {"keys": [SimpleNamespace(total_variance=4.0)], "values": [SimpleNamespace(total_variance=0.5)]}
    cal = SimpleNamespace(pcas=pca, stats={"kv_split": {"value_weight": 2.0}})
    assert tiers.LADDER_VALUE_WEIGHT == 1.0
    assert tiers.kind_weight(cal, "keys", 0) == pytest.approx(1 / 4.0)
    # values count as keys, over their own energy: the calibration's value weight (its K/V split) is not read
    assert tiers.kind_weight(cal, "values", 0) == pytest.approx(1.0 / 0.5)
    nan = SimpleNamespace(pcas={"keys": [SimpleNamespace(total_variance=float("nan"))]}, stats={})
    assert tiers.kind_weight(nan, "keys", 0) == 1.0
