"""Token-adaptive rates (kvtc.codec.tiers): the ranking against a brute-force softmax, the tiered blob's round trip,
its masks' checks, and calibrations with and without mean queries."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import zlib

import pytest
import torch

from kvtc import KVLayout
from kvtc.calibration import Calibration, Recipe, fit_calibration
from kvtc.calibration.artifact import ratio_key
from kvtc.calibration.meta import FORMAT_VERSION
from kvtc.codec import Codec, attention, container, tiers
from kvtc.errors import CalibrationError, FormatError
from kvtc.rope import RopeKind, RopeSpec
from synthetic import LowRankSource, make_slice

D = 16
LAYOUT = KVLayout(layers=(0, 1, 2), num_kv_heads=2, head_dim=D, dtype="float32", max_tokens=(0, 60, 0))
G = 2  # query heads per KV head


def _rope() -> RopeSpec:
    inv = tuple(float(torch.tensor(10000 ** (-2 * i / D), dtype=torch.float32)) for i in range(D // 2))
    return RopeSpec(D, False, (RopeKind("full", "default", inv),), ("full", "full", "full"))


@pytest.fixture(scope="module")
def cal() -> Calibration:
    return tiered_calibration()


def tiered_calibration() -> Calibration:
    """A synthetic calibration with plans at 4x, 8x and 12x and random mean queries: 8x is coded in tiers."""
    p = LAYOUT.num_features
    ks, vs = LowRankSource(p, decay=1e-3, noise=1e-3, seed=1), LowRankSource(p, decay=1e-2, noise=1e-3, seed=2)
    rows = [(ks.rows(1024), vs.rows(1024)) for _ in range(4)]
    base = fit_calibration(LAYOUT, rows, Recipe(ratios=(4, 8, 12), dp_rows=1024), rope=_rope().to_dict())
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(LAYOUT.layers), LAYOUT.num_kv_heads, G, D, generator=gen)
    return dataclasses.replace(base, queries=q, query_scales=torch.full((3,), D**-0.5))


def tiered_slice(batch: int = 2, tokens: int = 200, seed: int = 5):
    p = LAYOUT.num_features
    k = LowRankSource(p, decay=1e-3, noise=1e-3, seed=1).rows(batch * tokens)
    v = LowRankSource(p, decay=1e-2, noise=1e-3, seed=2).rows(batch * tokens)
    kv = make_slice(LAYOUT, k, v, batch=batch, start=seed)
    held = LAYOUT.held(1, tokens)
    kv.keys[:, : tokens - held, 1] = 0  # the sliding layer holds only its newest tokens
    kv.values[:, : tokens - held, 1] = 0
    return kv


def test_attention_mass_matches_a_brute_force_softmax(cal):
    kv = tiered_slice(batch=2, tokens=150)
    rope = _rope()
    B, T = kv.batch, kv.num_tokens
    q_idx = torch.linspace(T - attention.RECENT, T - 1, attention.QUERY_POSITIONS).round().long().unique()
    want = {m: torch.zeros(B, 3, T, dtype=torch.float64) for m in (1, 2)}  # summed probabilities, and their squares
    for b in range(B):
        for i in range(3):
            held = LAYOUT.held(i, T)
            limit = LAYOUT.limit(i)
            for h in range(LAYOUT.num_kv_heads):
                for g in range(G):
                    for t in q_idx.tolist():
                        pq = kv.positions[b, t]
                        qr = rope.apply(cal.queries[i, h, g].double().view(1, 1, 1, 1, D), pq.view(1, 1), [i])
                        logits = torch.full((T,), -math.inf, dtype=torch.float64)
                        for n in range(T - held, T):
                            pn = kv.positions[b, n]
                            if pn > pq or (limit and pq - pn >= limit):
                                continue
                            kr = rope.apply(kv.keys[b, n, i, h].double().view(1, 1, 1, 1, D), pn.view(1, 1), [i])
                            logits[n] = float((qr * kr).sum()) * D**-0.5
                        if logits.max() > -math.inf:  # a query that sees no held token gives none of them mass
                            for m, w in want.items():
                                w[b, i] += torch.softmax(logits, 0) ** m
    for m, w in want.items():
        got = attention.attention_mass(kv.keys, kv.positions, LAYOUT, cal.queries, cal.query_scales, rope, moment=m)
        assert torch.allclose(got.double(), w, atol=1e-4), (m, float((got.double() - w).abs().max()))
        assert torch.all(got[:, 1, : T - LAYOUT.held(1, T)] == 0)  # no mass on tokens the sliding layer does not hold


def test_choose_marks_each_sequences_most_attended_tokens():
    mass = torch.rand(3, 2, 40, generator=torch.Generator().manual_seed(0))
    mask = tiers.choose(mass, [0, 1], 5, 30, 0.25).view(3, 30)
    k = tiers.high_count(30, 0.25)
    assert k == 8 and mask.sum(1).tolist() == [k] * 3
    for b in range(3):
        score = mass[b, :, 5:35].sum(0)
        assert set(mask[b].nonzero()[:, 0].tolist()) == set(score.topk(k).indices.tolist())


def test_tiered_blob_round_trips_and_spends_its_bits_on_the_chosen_tokens(cal):
    kv = tiered_slice()
    codec = Codec(cal, 8, window=16, tiers="two")  # the sliding layer (60 tokens) then codes some too
    assert codec.tiers == ("4", "12", 0.25) and codec.ladder is None
    blob = codec.encode(kv)
    info = Codec.inspect(blob)
    assert info["version"] == 3 and info["tiers"] == {"high": "4", "low": "12", "share": 0.25}
    names = [s["name"] for s in info["sections"]]
    assert names[3:5] == ["tiers.0", "tiers.1"] and "keys.0.lo.params" in names
    plain = Codec(cal, 8, tiers="none", window=16).encode(kv)
    assert Codec.inspect(plain)["version"] == 2 and abs(len(blob) / len(plain) - 1) < 0.1, (len(blob), len(plain))
    out = codec.decode(blob)
    assert torch.equal(Codec(cal, 12, tiers="none").decode(blob).keys, out.keys)  # any codec of it decodes it
    _, secs = codec._open(blob)
    for g, (start, m) in enumerate(container_middles(blob, cal)):
        mask = secs[f"tiers.{g}"].view(kv.batch, m)
        layers = tiers.group_layers(cal.columns[g], LAYOUT)
        err = (out.keys - kv.keys)[:, start : start + m][:, :, layers].square().flatten(2).sum(2)
        assert err[mask].mean() < 0.5 * err[~mask].mean()  # the high tier's tokens are coded far better
    for li, k, v in codec.decode_layers(blob):
        i = LAYOUT.layers.index(li)
        # the same reconstruction, up to float32 rounding (decode_layers multiplies zero-padded coefficients)
        assert torch.allclose(k, out.keys[:, :, i], atol=1e-5) and torch.allclose(v, out.values[:, :, i], atol=1e-5)


def container_middles(blob, cal):
    from kvtc.codec import spans

    header, _ = container.read_header(blob)
    return spans.group_middles(header, cal.grouping)


def _rewrite(blob: bytes, edit, version: int = 3) -> bytes:
    """``blob`` with its header and sections passed through ``edit(header_dict, sections_bytes)`` and the CRCs
    recomputed: what a hostile writer can produce."""
    _, _, _, hlen, _ = container.PREFIX.unpack_from(blob, 0)
    d = json.loads(blob[16 : 16 + hlen])
    off, bodies = 16 + hlen, []
    for s in d["sections"]:
        bodies.append(bytearray(blob[off : off + s[3]]))
        off += s[3]
    edit(d, bodies)
    for s, b in zip(d["sections"], bodies):
        s[2], s[3], s[4] = len(b), len(b), zlib.crc32(b)
    hdr = json.dumps(d, separators=(",", ":"), sort_keys=True).encode()
    return struct.pack("<4sHHII", b"KVTC", version, 0, len(hdr), zlib.crc32(hdr)) + hdr + b"".join(bodies)


def test_damaged_masks_and_tiers_are_refused(cal):
    codec = Codec(cal, 8, backend="raw", window=16, tiers="two")
    blob = codec.encode(tiered_slice())
    codec.decode(_rewrite(blob, lambda d, b: None))  # the rewrite alone keeps it valid

    def flip(d, b):
        i = [s[0] for s in d["sections"]].index("tiers.0")
        b[i][0] ^= 1

    with pytest.raises(FormatError, match="high-tier tokens"):
        codec.decode(_rewrite(blob, flip))

    for bad in (["4", "5", 0.25], ["4", "12", 1.5], ["4", "12"], "4/12"):
        with pytest.raises(FormatError, match="tier"):
            codec.decode(_rewrite(blob, lambda d, b, bad=bad: d.__setitem__("tiers", bad)))
    with pytest.raises(FormatError, match="section"):  # another share: other section sizes than the blob has
        codec.decode(_rewrite(blob, lambda d, b: d.__setitem__("tiers", ["4", "12", 0.5])))
    with pytest.raises(FormatError):  # version 2 cannot carry tiers
        codec.decode(blob[:4] + struct.pack("<H", 2) + blob[6:])


def test_unpack_mask_checks_size_padding_and_counts():
    mask = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0, 0], dtype=torch.bool)  # 2 sequences x 5, 1 high each at 0.25
    data = tiers.pack_mask(mask)
    assert torch.equal(tiers.unpack_mask(data, 2, 5, 0.25, "t"), mask)
    with pytest.raises(FormatError, match="bytes"):
        tiers.unpack_mask(data + b"\0", 2, 5, 0.25, "t")
    with pytest.raises(FormatError, match="padding"):
        tiers.unpack_mask(bytes([data[0], data[1] | 0x80]), 2, 5, 0.25, "t")
    with pytest.raises(FormatError, match="high-tier"):
        tiers.unpack_mask(tiers.pack_mask(torch.tensor([1, 1, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)), 2, 5,
                          0.25, "t")  # fmt: skip


def test_calibration_with_queries_keeps_its_name(cal, tmp_path):
    plain = dataclasses.replace(cal, queries=None, query_scales=None)
    assert cal.hash == plain.hash  # decoding never reads the queries
    assert cal.version == plain.version == FORMAT_VERSION  # the file, not its version, tells the queries
    back = Calibration.load(cal.save(tmp_path / "c.safetensors"))
    assert torch.equal(back.queries, cal.queries) and torch.equal(back.query_scales, cal.query_scales)
    assert back.hash == cal.hash
    blob = Codec(cal, 8).encode(tiered_slice())
    assert torch.equal(Codec(plain, 8).decode(blob).keys, Codec(cal, 8).decode(blob).keys)
    assert Codec(plain, 8).tiers is None and Codec.inspect(Codec(plain, 8).encode(tiered_slice()))["tiers"] is None
    with pytest.raises(CalibrationError, match="records queries"):
        Codec(plain, 8, tiers=(4, 12))
    with pytest.raises(CalibrationError, match="no bit plan for ratio 6"):
        Codec(cal, 8, tiers=(6, 12))
    with pytest.raises(ValueError, match="'auto', 'two', 'none' or"):
        Codec(cal, 8, tiers="three")
    assert Codec(cal, 4).tiers is None  # no plans at 2 and 6: one plan for every token
    with pytest.raises(CalibrationError, match="mean queries must be"):
        dataclasses.replace(cal, queries=cal.queries[:, :1])
    with pytest.raises(CalibrationError, match="positive"):
        dataclasses.replace(cal, query_scales=-cal.query_scales)


def test_shard_keeps_each_heads_queries(cal):
    full = KVLayout(layers=(0, 1), num_kv_heads=2, head_dim=D, dtype="float32")
    p = full.num_features
    src = LowRankSource(p, seed=4)
    rows = [(src.rows(512), src.rows(512)) for _ in range(2)]
    from kvtc.layout import PCAGrouping

    base = fit_calibration(full, rows, Recipe(ratios=(8,), grouping=PCAGrouping("head_shards", 2), dp_rows=512))
    q = torch.randn(2, 2, G, D)
    c = dataclasses.replace(base, queries=q, query_scales=torch.ones(2))
    assert torch.equal(c.shard((1,)).queries, q[:, 1:])


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_yarn"])
def test_the_recorder_gives_each_heads_mean_pre_rope_query_and_leaves_the_output_alone(name):
    """The recorder's mean queries equal the mean of the model's own pre-RoPE queries (hooked before RoPE: the
    output of ``q_norm`` or ``q_proj``) past the sinks; logits are those of the model's sdpa attention; the model's
    attention implementation is restored."""
    from kvtc.integrations.hf import describe_model
    from kvtc.integrations.hf.queries import recording_queries
    from tiny_models import build

    model = build(name)
    model.set_attn_implementation("sdpa")
    layout, rope = describe_model(model)
    cfg = model.config
    hq, hd = cfg.num_attention_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    seen: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        target = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj

        def hook(_m, _a, out, i=i):
            t = out if out.dim() == 4 else out.view(out.shape[0], out.shape[1], hq, hd)
            t = t.transpose(1, 2) if t.shape[1] == hq and t.shape[2] != hq else t  # -> [B, T, Hq, D]
            seen.setdefault(i, []).append(t.detach().float())

        hooks.append(target.register_forward_hook(hook))
    ids = torch.randint(3, 120, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits = model(ids).logits
        seen.clear()
        with recording_queries(model, layout, rope, sinks=4) as rec:
            got_logits = model(ids).logits
    for h in hooks:
        h.remove()
    assert model.config._attn_implementation == "sdpa"
    assert torch.allclose(got_logits, want_logits, atol=1e-5)
    q, scales = rec.result()
    G = hq // layout.num_kv_heads
    for i, layer in enumerate(layout.layers):
        mean = torch.cat(seen[layer], 0)[:, 4:].mean((0, 1)).view(layout.num_kv_heads, G, hd)
        assert torch.allclose(q[i], mean, atol=1e-4), (name, layer)
    assert torch.allclose(scales, torch.tensor([m.self_attn.scaling for m in model.model.layers]).float()[
        list(layout.layers)])  # fmt: skip


def _with_map(cal: Calibration, weights: float = 0.0, seed: int = 6) -> Calibration:
    """``cal`` plus a key-to-query map: random weights times ``weights``, intercept the mean queries."""
    L, H = len(LAYOUT.layers), LAYOUT.num_kv_heads
    m = torch.randn(L, H, D + 1, G * D, generator=torch.Generator().manual_seed(seed)) * weights
    m[:, :, D] = cal.queries.reshape(L, H, G * D)
    return dataclasses.replace(cal, query_map=m)


def test_a_map_without_weights_ranks_as_the_mean_queries(cal):
    kv = tiered_slice(batch=2, tokens=150)
    rope = _rope()
    mean = attention.attention_mass(kv.keys, kv.positions, LAYOUT, cal.queries, cal.query_scales, rope)
    flat = attention.attention_mass(
        kv.keys, kv.positions, LAYOUT, cal.queries, cal.query_scales, rope, _with_map(cal).query_map
    )
    assert torch.allclose(flat, mean, atol=1e-6)
    m = _with_map(cal, 0.5).query_map
    moved = attention.attention_mass(kv.keys, kv.positions, LAYOUT, cal.queries, cal.query_scales, rope, m)
    assert not torch.allclose(moved, mean, atol=1e-3)  # the keys' own queries move the mass
    k = kv.keys[:, -3:].float()
    q = attention.predicted_queries(k, m)  # against the regression written out
    want = torch.einsum("bqlhd,lhde->bqlhe", k, m[:, :, :D]) + m[:, :, D]
    assert torch.allclose(q, want.reshape(q.shape), atol=1e-5) and q.shape == (2, 3, 3, LAYOUT.num_kv_heads * G, D)


def test_calibration_with_a_query_map_keeps_its_name(cal, tmp_path):
    mapped = _with_map(cal, 0.1)
    assert mapped.version == FORMAT_VERSION and mapped.hash == cal.hash  # decoding never reads it
    back = Calibration.load(mapped.save(tmp_path / "m.safetensors"))
    assert back.version == FORMAT_VERSION and torch.equal(back.query_map, mapped.query_map)
    blob = Codec(back, 8).encode(tiered_slice())
    assert Codec.inspect(blob)["rungs"] is not None  # the default: the rate ladder
    assert torch.equal(Codec(cal, 8).decode(blob).keys, Codec(back, 8).decode(blob).keys)
    with pytest.raises(CalibrationError, match="key-to-query map must be"):
        dataclasses.replace(mapped, query_map=mapped.query_map[..., :-1])
    with pytest.raises(CalibrationError, match="comes with the mean queries"):
        dataclasses.replace(mapped, queries=None, query_scales=None)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_the_recorders_key_to_query_map_is_a_least_squares_fit(name):
    """The map predicts the model's own pre-RoPE queries from its pre-RoPE keys about as well as an exact
    least-squares fit on the same tokens."""
    from kvtc.integrations.hf import describe_model
    from kvtc.integrations.hf.queries import recording_queries
    from tiny_models import build

    model = build(name)
    model.set_attn_implementation("sdpa")
    layout, rope = describe_model(model)
    cfg = model.config
    hq, hd = cfg.num_attention_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    seen: dict[tuple[str, int], list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for part in ("q", "k"):
            target = getattr(attn, f"{part}_norm", None) or getattr(attn, f"{part}_proj")

            def hook(_m, _a, out, i=i, part=part):
                n = hq if part == "q" else layout.num_kv_heads
                t = out if out.dim() == 4 else out.view(out.shape[0], out.shape[1], n, hd)
                t = t.transpose(1, 2) if t.shape[1] == n and t.shape[2] != n else t  # -> [B, T, heads, D]
                seen.setdefault((part, i), []).append(t.detach().float())

            hooks.append(target.register_forward_hook(hook))
    ids = torch.randint(3, 120, (6, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), recording_queries(model, layout, rope, sinks=4, keys=True) as rec:
        model(ids)
    for h in hooks:
        h.remove()
    m = rec.query_map()
    G = hq // layout.num_kv_heads
    assert m.shape == (len(layout.layers), layout.num_kv_heads, hd + 1, G * hd)
    for i, layer in enumerate(layout.layers):
        q = torch.cat(seen[("q", layer)], 0)[:, 4:].double()  # [B, n, Hq, D]
        k = torch.cat(seen[("k", layer)], 0)[:, 4:].double()
        for h in range(layout.num_kv_heads):
            x = torch.cat([k[:, :, h].reshape(-1, hd), torch.ones(k.shape[0] * k.shape[1], 1, dtype=torch.float64)], 1)
            y = q[:, :, h * G : (h + 1) * G].reshape(-1, G * hd)
            exact = torch.linalg.lstsq(x, y).solution
            best, got = (float((y - x @ a).pow(2).sum()) for a in (exact, m[i, h].double()))
            mean_res = float((y - y.mean(0)).pow(2).sum())
            # within 5% of the query variance of what least squares explains (the ridge shrinks a little)
            assert best <= got * (1 + 1e-9) and got <= best + 0.05 * mean_res, (name, layer, h)


def test_auto_tiers_concentrate_from_24x_and_fall_back_without_their_plans():
    assert tiers.tier_targets(16) == (8, 24) and tiers.tier_targets(32) == (12, 192)
    assert tiers.tier_targets(24) == (12, 144) and tiers.tier_targets(64) == (16, 192)
    assert tiers.tier_candidates(16) == [(8, 24)]
    assert tiers.tier_candidates(32) == [(12, 192), (16, 96), (16, 48)]
    assert tiers.tier_candidates(192) == [(96, 576), (96, 288)]  # a low tier at the cap would not bracket 192x
    assert math.isclose(tiers.share(32, 12, 192), 1 / 3) and math.isclose(tiers.share(16, 8, 24), 0.25)
    # where the calibration predicts its plans' error, that decides: a near-lossless 32x keeps half and 1.5 times
    assert tiers.tier_candidates(32, plain_error=0.02) == [(16, 48)]
    assert tiers.tier_candidates(16, plain_error=0.09)[0] == (12, 96)
    p = LAYOUT.num_features
    ks, vs = LowRankSource(p, decay=1e-3, noise=1e-3, seed=1), LowRankSource(p, decay=1e-2, noise=1e-3, seed=2)
    rows = [(ks.rows(1024), vs.rows(1024)) for _ in range(4)]
    q = torch.randn(len(LAYOUT.layers), LAYOUT.num_kv_heads, G, D, generator=torch.Generator().manual_seed(3))

    def with_ratios(*ratios, lossy=True):
        base = fit_calibration(LAYOUT, rows, Recipe(ratios=ratios, dp_rows=1024), rope=_rope().to_dict())
        err = {ratio_key(r): {"keys": [0.2 if lossy else 0.01], "values": [0.01]} for r in ratios}
        stats = {**base.stats, "predicted_relative_error": err}
        return dataclasses.replace(base, queries=q, query_scales=torch.full((3,), D**-0.5), stats=stats)

    concentrated = with_ratios(12, 24, 36, 72, 144)
    assert Codec(concentrated, 24, window=16, tiers="two").tiers == ("12", "144", round(tiers.share(24, 12, 144), 6))
    assert Codec(with_ratios(12, 24, 36, 72, 144, lossy=False), 24, window=16, tiers="two").tiers == ("12", "36", 0.25)
    wide = with_ratios(12, 24, 36, 72)  # an r13-style ladder without 144x: half and three times
    assert Codec(wide, 24, window=16, tiers="two").tiers == ("12", "72", 0.4)
    older = with_ratios(12, 24, 36)  # an r11/r12 ladder: no plan at 3 times the target
    assert Codec(older, 24, window=16, tiers="two").tiers == ("12", "36", 0.25)
    assert Codec(with_ratios(24, 36), 24, window=16, tiers="two").tiers is None  # no high tier: one plan
    blob = Codec(wide, 24, window=16, tiers="two").encode(tiered_slice())
    assert Codec.inspect(blob)["tiers"] == {"high": "12", "low": "72", "share": 0.4}
    assert Codec(wide, 12, tiers="none").decode(blob).keys.shape == tiered_slice().keys.shape


def test_plain_error_reads_the_fit_stats_and_ignores_malformed_ones():
    from types import SimpleNamespace

    def cal(stats):
        return SimpleNamespace(stats=stats)

    good = {"predicted_relative_error": {"32": {"keys": [0.01, 0.09], "values": [0.05]}}}
    assert tiers.plain_error(cal(good), 32) == 0.09 and tiers.plain_error(cal(good), 16) is None
    for bad in ({}, {"predicted_relative_error": []}, {"predicted_relative_error": {"32": {"keys": [None]}}},
                {"predicted_relative_error": {"32": {"keys": 5}}}, {"predicted_relative_error": {"32": "x"}}):  # fmt: skip
        assert tiers.plain_error(cal(bad), 32) is None  # then the target alone decides (WIDE_FROM)
