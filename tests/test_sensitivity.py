"""Sensitivity-weighted calibration: feature scales from loss gradients, the weighted PCA/DP, the codec's
encode/decode bases, and the calibration file's feature scales."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvtc import KVLayout
from kvtc.calibration import Calibration, Recipe, fit_calibration, sensitivity_scales
from kvtc.calibration.dp import DEFAULT_TYPES, PAPER_TYPES, Plan
from kvtc.calibration.meta import FORMAT_VERSION
from kvtc.codec import Codec
from kvtc.errors import CalibrationError
from kvtc.quant import INT1S, INT4S, fixed_step
from synthetic import LowRankSource, make_slice

LAYOUT = KVLayout(layers=(0, 1), num_kv_heads=2, head_dim=16)  # p = 64, four (layer, head) blocks of 16
P = LAYOUT.num_features
#: the default types but the one-bit one: plans a version-4 reader knows
V4_TYPES = tuple(t for t in DEFAULT_TYPES if t != INT1S and not fixed_step(t))


def _rows(seed: int, n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    src = LowRankSource(P, decay=1e-2, seed=seed)
    k, v = src.rows(n), LowRankSource(P, decay=1e-2, seed=seed + 7).rows(n)
    # the first (layer, head) block carries most of the energy: an unweighted PCA spends its bits there
    k[:, :16] *= 8.0
    v[:, :16] *= 8.0
    return k, v


def _scales() -> dict[str, torch.Tensor]:
    # ... but the loss barely feels that block and feels the last one a lot
    w = torch.ones(P)
    w[:16] = 1e-3
    w[48:] = 20.0
    return sensitivity_scales({"keys": w, "values": w.clone()}, floor=1e-4)


def _weighted_err(x: torch.Tensor, xhat: torch.Tensor, s: torch.Tensor) -> float:
    return float(((x.double() - xhat.double()) * s.double()).square().sum())


@pytest.fixture(scope="module")
def cals() -> tuple[Calibration, Calibration, dict[str, torch.Tensor]]:
    k, v = _rows(0)
    rows = [(k[i : i + 1024], v[i : i + 1024]) for i in range(0, k.shape[0], 1024)]
    scales = _scales()
    plain = fit_calibration(LAYOUT, rows, Recipe(ratios=(4, 8), dp_rows=512))
    weighted = fit_calibration(LAYOUT, rows, Recipe(ratios=(4, 8), dp_rows=512), feature_scale=scales)
    return plain, weighted, scales


def test_sensitivity_scales_normalise_each_kind_and_floor() -> None:
    k = torch.tensor([1.0, 3.0, 0.0, 0.0])
    v = torch.tensor([4.0, 4.0, 8.0, 8.0])
    s = sensitivity_scales({"keys": k, "values": v}, floor=0.01)  # each kind to mean 1, one weight per feature
    assert torch.allclose(s["keys"], torch.tensor([1.0, 3.0, 0.01, 0.01]).sqrt())
    assert torch.allclose(s["values"], torch.tensor([4 / 6, 4 / 6, 8 / 6, 8 / 6]).sqrt())
    for bad in ({"keys": k}, {"keys": -k, "values": v}, {"keys": k, "values": torch.zeros(3)}):
        with pytest.raises(CalibrationError):
            sensitivity_scales(bad)
    with pytest.raises(CalibrationError, match="zero"):
        sensitivity_scales({"keys": torch.zeros(4), "values": v})
    with pytest.raises(CalibrationError, match="floor"):
        sensitivity_scales({"keys": k, "values": v}, floor=0)


def test_weighted_calibration_lowers_the_weighted_error_at_the_same_bytes(cals) -> None:
    plain, weighted, scales = cals
    k, v = _rows(1, 512)  # held out
    kv = make_slice(LAYOUT, k, v)
    for ratio in (4, 8):
        got = {}
        for name, cal in (("plain", plain), ("weighted", weighted)):
            codec = Codec(cal, ratio, sinks=0, window=0)
            blob = codec.encode(kv)
            out = codec.decode(blob)
            got[name] = (
                sum(
                    _weighted_err(
                        getattr(kv, kd).float().reshape(-1, P), getattr(out, kd).float().reshape(-1, P), scales[kd]
                    )
                    for kd in ("keys", "values")
                ),
                sum(
                    float((getattr(kv, kd).double() - getattr(out, kd).double()).square().sum())
                    for kd in ("keys", "values")
                ),
                len(blob),  # the stored rate fits each plan's stored bytes to the target
            )
        # about the same bytes (each plan fitted to its target on the calibration's held-out rows: within 15% on
        # these few synthetic rows), and each calibration wins on the error it minimises by far more than that
        assert abs(got["weighted"][2] / got["plain"][2] - 1) < 0.15, (ratio, got)
        assert got["weighted"][0] < 0.5 * got["plain"][0], (ratio, got)
        assert got["plain"][1] < got["weighted"][1], (ratio, got)


def test_weighted_codec_is_near_lossless_at_a_generous_ratio() -> None:
    # a wrong encode/decode basis pair (scale applied once, twice or on the wrong side) fails this at once
    k, v = _rows(2)
    scales = _scales()
    cal = fit_calibration(LAYOUT, [(k, v)], Recipe(ratios=(1.5,), dp_rows=1024), feature_scale=scales)
    kv = make_slice(LAYOUT, k[:256], v[:256])
    codec = Codec(cal, 1.5, sinks=0, window=0)
    out = codec.decode(codec.encode(kv))
    for kd in ("keys", "values"):
        sc = scales[kd].double().reshape(2, 2, 16)  # [layers, heads, head_dim]
        x, xh = getattr(kv, kd).double() * sc, getattr(out, kd).double() * sc
        # relative to the weighted energy: what the weighted PCA and DP control
        rel = float((x - xh).square().sum() / (x - x.mean(dim=(0, 1))).square().sum())
        assert rel < 1e-3, (kd, rel)


def test_layer_by_layer_decode_uses_the_weighted_decode_basis(cals) -> None:
    _, weighted, _ = cals
    k, v = _rows(3, 300)
    kv = make_slice(LAYOUT, k, v)
    codec = Codec(weighted, 8, sinks=4, window=16)
    blob = codec.encode(kv)
    whole = codec.decode(blob)
    for li, (_layer, lk, lv) in enumerate(codec.decode_layers(blob)):
        assert torch.allclose(lk.float(), whole.keys[:, :, li].float(), atol=1e-4, rtol=1e-4)
        assert torch.allclose(lv.float(), whole.values[:, :, li].float(), atol=1e-4, rtol=1e-4)


def test_weighted_calibration_file_roundtrip_and_version(cals, tmp_path) -> None:
    plain, weighted, scales = cals
    assert weighted.weighted and not plain.weighted
    for kd in ("keys", "values"):
        assert torch.equal(weighted.feature_scale(kd), scales[kd])
    path = weighted.save(tmp_path / "w.safetensors")
    back = Calibration.load(path)
    assert back.hash == weighted.hash and back.weighted
    assert torch.equal(back.pcas["keys"][0].scale, weighted.pcas["keys"][0].scale)
    for data in (path.read_bytes(), plain.to_bytes()):
        assert json.loads(_meta(data))["version"] == FORMAT_VERSION
    assert weighted.stats["kv_split"]["errors"] == "relative"


def test_a_scaled_group_without_its_scale_is_refused(cals) -> None:
    _, weighted, _ = cals
    data = weighted.to_bytes()
    # a scaled group whose scale tensor is missing is corrupt, not silently unweighted
    meta = json.loads(_meta(data))
    meta["pca"]["keys"][0]["scaled"] = False
    with pytest.raises(CalibrationError):
        Calibration.from_bytes(_with_meta(data, json.dumps(meta, sort_keys=True)))


def test_extended_types_and_one_bit_plans_round_trip() -> None:
    k, v = _rows(0)
    paper = fit_calibration(LAYOUT, [(k, v)], Recipe(ratios=(8,), dp_rows=512, types=PAPER_TYPES))
    ours = fit_calibration(LAYOUT, [(k, v)], Recipe(ratios=(8,), dp_rows=512, types=V4_TYPES), feature_scale=_scales())
    assert not paper.extended_types and ours.extended_types
    plan = Plan(((1, INT4S, 4), (4, INT1S, 2)), clips=(1.0,) * 4 + (0.3125, 0.375))
    one_bit = dataclasses.replace(ours, plans={"8": {"keys": [plan], "values": [plan]}})
    assert one_bit.version == FORMAT_VERSION and INT1S in one_bit.types and one_bit.extended_types
    back = Calibration.from_bytes(one_bit.to_bytes())
    assert back.hash == one_bit.hash and back.plans["8"]["keys"][0] == plan


def test_bad_feature_scales_are_refused() -> None:
    k, v = _rows(4, 256)
    for bad in (
        {"keys": torch.ones(P)},
        {"keys": torch.ones(P), "values": torch.zeros(P)},
        {"keys": torch.ones(P - 1), "values": torch.ones(P - 1)},
        {"keys": torch.full((P,), float("nan")), "values": torch.ones(P)},
    ):
        with pytest.raises(CalibrationError, match="feature_scale"):
            fit_calibration(LAYOUT, [(k, v)], Recipe(ratios=(4,)), feature_scale=bad)


def _meta(data: bytes) -> str:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])["__metadata__"]["kvtc"]


def _with_meta(data: bytes, meta: str) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["kvtc"] = meta
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def test_measured_sensitivity_predicts_which_heads_the_loss_feels(smollm2, sotu_calib_texts) -> None:
    """On the real model: noise of the same energy costs more loss in the (layer, head) the gradient
    ranks most sensitive than in the one it ranks least, and the sinks and recent window are not counted."""
    from kvtc.eval.protocols import _prefill
    from kvtc.integrations.hf import extract_slice, rebuild_cache
    from kvtc.integrations.hf_calibrate import corpus_windows, measure_sensitivity
    from kvtc.layout import KVSlice

    model, tok = smollm2
    ctx, cont = 320, 48
    sens = measure_sensitivity(
        model, tok, sotu_calib_texts, windows=2, context=ctx, continuation=cont, sinks=4, recent=64, progress=False
    )
    layout = extract_slice(_prefill(model, torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])), model).layout
    assert set(sens) == {"keys", "values"}
    for kd in ("keys", "values"):
        assert sens[kd].shape == (layout.num_features,) and bool((sens[kd] >= 0).all()) and float(sens[kd].sum()) > 0
    per_head = sens["values"].reshape(len(layout.layers), layout.num_kv_heads, layout.head_dim).mean(-1)
    hi, lo = divmod(int(per_head.argmax()), layout.num_kv_heads), divmod(int(per_head.argmin()), layout.num_kv_heads)
    assert float(per_head.max()) > 20 * float(per_head.min())  # far from uniform: weighting has work to do

    ids = next(corpus_windows(tok, sotu_calib_texts, ctx + cont + 1, 1))
    kv = extract_slice(_prefill(model, ids[:ctx]), model)
    targets = ids[ctx + 1 :]

    def loss_with_noise(layer: int, head: int) -> float:
        gen = torch.Generator().manual_seed(0)
        values = kv.values.clone()
        block = values[:, 4 : ctx - 64, layer, head]
        values[:, 4 : ctx - 64, layer, head] = block + 0.3 * block.std() * torch.randn(block.shape, generator=gen)
        cache = rebuild_cache(KVSlice(kv.layout, kv.keys, values, kv.positions), model)
        with torch.inference_mode():
            logits = model(input_ids=ids[None, ctx:-1], past_key_values=cache, use_cache=True).logits[0]
        return float(torch.nn.functional.cross_entropy(logits.float(), targets))

    cache = rebuild_cache(kv, model)
    with torch.inference_mode():
        base = float(
            torch.nn.functional.cross_entropy(
                model(input_ids=ids[None, ctx:-1], past_key_values=cache, use_cache=True).logits[0].float(), targets
            )
        )
    d_hi, d_lo = abs(loss_with_noise(*hi) - base), abs(loss_with_noise(*lo) - base)
    assert d_hi > 5 * d_lo, (hi, lo, d_hi, d_lo)


def test_weighted_rows_stream_one_chunk_at_a_time() -> None:
    """A one-pass source (a generator of chunks) stays streamed when weighted: memory O(p²), not O(rows)."""
    from kvtc.calibration.fit import _scaled_source

    pulled = []

    def chunks():
        for i in range(3):
            pulled.append(i)
            yield torch.ones(4, P), torch.ones(4, P)

    scales = _scales()
    it = iter(_scaled_source(chunks(), scales["keys"], scales["values"]))
    k, v = next(it)
    assert pulled == [0] and torch.allclose(k[0], scales["keys"])
    k, v = _rows(5, 512)
    gen_cal = fit_calibration(
        LAYOUT,
        ((k[i : i + 128], v[i : i + 128]) for i in range(0, 512, 128)),
        Recipe(ratios=(4,), dp_rows=512),
        feature_scale=scales,
    )
    list_cal = fit_calibration(
        LAYOUT,
        [(k[i : i + 128], v[i : i + 128]) for i in range(0, 512, 128)],
        Recipe(ratios=(4,), dp_rows=512),
        feature_scale=scales,
    )
    assert torch.equal(gen_cal.pcas["keys"][0].basis, list_cal.pcas["keys"][0].basis)


def test_codec_keeps_one_basis_copy_unless_weighted(cals) -> None:
    """Encode and decode share the basis of an unweighted calibration (one device copy, not two); a weighted one
    needs its two distinct matrices."""
    plain, weighted, _ = cals
    for cal, shared in ((plain, True), (weighted, False)):
        codec = Codec(cal, 8)
        # the cached entry itself (on a GPU each entry is its own device copy)
        tr = codec._transform
        assert (tr.basis_fp32("keys", 0) is tr.basis_fp32("keys", 0, decode=True)) is shared
