"""The token map (a linear prediction of each token's K/V from its token ids) and container version 5.

The fit is checked against relations it must recover; the format against a checked-in fixture (a calibration with a
token map, a blob with its token ids) decoded and re-encoded byte for byte; hostile or mismatched input against
typed errors. The map on a real model (Gemma-3-270M) is exercised in test_gemma3.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvtc import KVSlice
from kvtc.calibration import Calibration
from kvtc.calibration.meta import read_meta
from kvtc.calibration.token_map import LAGS, TokenMapFit, lagged, water_filling
from kvtc.codec import Codec, container
from kvtc.errors import CalibrationError, CalibrationMismatch, FormatError

FIX = Path(__file__).parent / "fixtures" / "predicted"


def synthetic(vocab=40, dim=5, p=12, windows=12, tokens=200, noise=0.05, related=True, seed=0, block=None):
    """Windows of random ids whose K/V are a fixed linear function of the lagged embeddings (plus noise)."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, dim, generator=g) * 3 + 1
    w = {k: torch.randn(LAGS * dim, p, generator=g) for k in ("keys", "values")}
    fit = TokenMapFit(emb, p, block=block)
    truth = []
    for i in range(windows):
        ids = torch.randint(0, vocab, (tokens,), generator=g)
        x = lagged(emb, ids[None], LAGS)[0]
        rows = {}
        for k in w:
            signal = x @ w[k] if related else torch.randn(tokens, p, generator=g) * 5
            rows[k] = signal + 2.0 + noise * torch.randn(tokens, p, generator=g)
        fit.add(ids, {k: r[4:] for k, r in rows.items()}, 4, held_out=i >= windows - 3)
        truth.append((ids, rows))
    return emb, fit, truth


def test_fit_recovers_a_linear_relation_and_centres_its_predictions():
    emb, fit, truth = synthetic()
    gain = fit.gain()
    assert gain["keys"] > 0.95 and gain["values"] > 0.95, gain
    tm = fit.result(emb.shape[0], gain)
    tm.validate(12)
    ids, rows = truth[0]
    x = tm.features(emb, ids[None], torch.device("cpu"))[0, 4:]
    for k in ("keys", "values"):
        ybar = torch.cat([r[k][4:] for _, r in truth]).mean(0)
        resid = rows[k][4:] - tm.predict(x, k)
        # what is left is the rows' mean, the noise and what the ridge shrinks: the prediction is the deviation
        assert float((resid - ybar).norm() / (rows[k][4:] - ybar).norm()) < 0.15
    # over every fitting row the predictions average to zero (the residuals keep the rows' mean)
    xs = torch.cat([tm.features(emb, i[None], torch.device("cpu"))[0, 4:] for i, _ in truth])
    assert float(tm.predict(xs, "keys").mean(0).abs().max()) < 0.05


@pytest.mark.parametrize("block", [None, 4])
def test_fit_finds_no_gain_where_ids_say_nothing(block):
    _, fit, _ = synthetic(related=False, block=block)
    gain = fit.gain()
    assert gain["keys"] < 0.05 and gain["values"] < 0.05, gain  # the calibration's "auto" then leaves it out


def test_gain_over_blocks():
    """One block of every feature is the whole p x p measurement; blocks of a layer's features measure over their
    own spectra (another figure, still finding the relation the ids carry); blocks must tile the features."""
    whole = synthetic(noise=1.0, block=None)[1].gain()
    assert synthetic(noise=1.0, block=12)[1].gain() == pytest.approx(whole, rel=1e-9)
    blocks = synthetic(noise=1.0, block=4)[1].gain()
    assert 0.5 < blocks["keys"] < 1 and blocks["keys"] != pytest.approx(whole["keys"], rel=1e-6)
    with pytest.raises(CalibrationError, match="tile"):
        TokenMapFit(torch.randn(4, 2), 12, block=5)


def test_cross_fitted_maps_do_not_flatter_the_rows_they_residualise():
    """Rows the ids say nothing about: the map fitted on them "explains" part of them (in-sample residuals smaller
    than the rows), while each part's rows less the other part's map keep their energy, as text the map never saw
    does. Calibration residualises its own windows that way (fit_token_map), so plans are not sized on flattered
    rows."""
    g = torch.Generator().manual_seed(3)
    vocab, dim, p, tokens = 400, 48, 16, 120
    emb = torch.randn(vocab, dim, generator=g)
    fit = TokenMapFit(emb, p)
    windows = []
    for i in range(8):
        ids = torch.randint(0, vocab, (tokens,), generator=g)
        rows = {k: torch.randn(tokens - 4, p, generator=g) for k in ("keys", "values")}
        fit.add(ids, rows, 4, held_out=bool(i % 2))
        windows.append((ids, rows))
    whole, halves = fit.result(vocab), (fit.result(vocab, part=0), fit.result(vocab, part=1))

    def energy(tm, ids, y):  # noqa: ANN001, ANN202
        x = tm.features(emb, ids[None], torch.device("cpu"))[0, 4:]
        return float((y - tm.predict(x, "keys")).square().sum())

    rows = sum(float(w["keys"].square().sum()) for _, w in windows)
    in_sample = sum(energy(whole, ids, w["keys"]) for ids, w in windows)
    crossed = sum(energy(halves[1 - i % 2], ids, w["keys"]) for i, (ids, w) in enumerate(windows))
    assert in_sample < 0.9 * rows  # the bias cross-fitting removes
    assert crossed > rows


def test_water_filling_matches_the_closed_form():
    ev = torch.tensor([16.0, 4.0, 1.0, 0.01])
    # 3 bits over the first two: theta with (log2(16/t) + log2(4/t)) / 2 = 3 -> t = 1, the third sits at the water
    assert water_filling(ev, 3.0) == pytest.approx(1 + 1 + 1 + 0.01, rel=1e-6)
    assert water_filling(ev, 0.0) == pytest.approx(21.01, rel=1e-7)


def _fixture():
    cal = Calibration.load(FIX / "calibration.safetensors")
    emb = load_file(str(FIX / "embeddings.safetensors"))["weight"]
    inp = load_file(str(FIX / "sample_input.safetensors"))
    kv = KVSlice(cal.layout, inp["keys"], inp["values"], inp["positions"], "fixture", inp["token_ids"])
    return cal, emb, kv, (FIX / "sample.kvtc").read_bytes()


def test_fixture_decodes_and_reencodes_byte_exactly():
    cal, emb, kv, blob = _fixture()
    assert cal.version == 11 and cal.token_map is not None
    info = Codec.inspect(blob)
    assert info["version"] == 5 and [s["name"] for s in info["sections"]][:2] == ["positions", "tokens"]
    codec = Codec(cal, ratio=8, sinks=2, window=4, embeddings=emb)
    out = codec.decode(blob)
    want = load_file(str(FIX / "sample_decoded.safetensors"))
    for name in ("keys", "values", "positions"):
        assert torch.equal(getattr(out, name), want[name]), name
    assert torch.equal(out.token_ids, kv.token_ids)
    assert codec.encode(kv) == blob
    # the map carries most of these K/V: decoded without its prediction they are far off, with it close
    plain = codec._decode(blob)
    err = float((plain.keys.float() - kv.keys.float()).norm() / kv.keys.float().norm())
    good = float((out.keys.float() - kv.keys.float()).norm() / kv.keys.float().norm())
    assert good < 0.2 < err


def test_fixture_refuses_missing_or_foreign_embeddings_and_ids():
    cal, emb, kv, blob = _fixture()
    with pytest.raises(CalibrationMismatch, match="embeddings"):
        Codec(cal, ratio=8, sinks=2, window=4).decode(blob)
    with pytest.raises(CalibrationMismatch, match="not the ones"):
        Codec(cal, ratio=8, embeddings=emb + 1)
    codec = Codec(cal, ratio=8, sinks=2, window=4, embeddings=emb)
    with pytest.raises(CalibrationError, match="token_ids"):
        codec.encode(dataclasses.replace(kv, token_ids=None))
    with pytest.raises(CalibrationMismatch, match="vocabulary"):
        codec.encode(kv, token_ids=kv.token_ids + 1000)
    # a slice all of whose tokens are stored raw codes nothing, and needs no ids
    short = KVSlice(cal.layout, kv.keys[:, :6], kv.values[:, :6], kv.positions[:, :6], "fixture")
    assert Codec.inspect(codec.encode(short))["version"] == 1


def test_every_byte_flip_of_the_token_ids_is_rejected():
    cal, emb, _, blob = _fixture()
    codec = Codec(cal, ratio=8, sinks=2, window=4, embeddings=emb)
    header, body = container.read_header(blob)
    off = body
    for s in header.sections:
        if s.name == "tokens":
            for i in range(off, off + s.coded):
                bad = bytearray(blob)
                bad[i] ^= 0x21
                with pytest.raises(FormatError):
                    codec.decode(bytes(bad))
            break
        off += s.coded
    else:
        raise AssertionError("no tokens section")


def test_calibration_metadata_checks_its_token_map():
    raw = Calibration.load(FIX / "calibration.safetensors")
    meta = raw._meta()
    read_meta(json.dumps(meta), "x")  # as written: accepted
    for change in (
        {"version": 9},  # an older file: refused by its version
        {"token_map": {"lags": 3, "vocab": 64}},  # fields missing
        {"token_map": {"lags": 99, "vocab": 64, "gain": {}}},  # out of range
    ):
        bad = {**meta, **change}
        with pytest.raises(CalibrationError):
            read_meta(json.dumps(bad), "x")
    # a map of the wrong shape is refused when the calibration is built
    tm = raw.token_map
    with pytest.raises(CalibrationError, match="token map"):
        dataclasses.replace(raw, token_map=dataclasses.replace(tm, std=tm.std[:-1]))
    with pytest.raises(CalibrationError, match="positive"):
        dataclasses.replace(raw, token_map=dataclasses.replace(tm, std=-tm.std))
