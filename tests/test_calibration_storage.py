"""How a calibration stores its PCA bases: float16, rounded when the calibration is made.

A fitted calibration holds what its file will hold (the same tensors, the same hash), so a blob encoded with it
decodes with the saved file; a basis of another dtype is refused. Older files (versions 1-9) are refused: rebuild.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save

from kvtc import KVLayout, PCAGrouping
from kvtc.calibration import Calibration, Recipe, fit_calibration
from kvtc.calibration.digest import content_hash
from kvtc.calibration.meta import FORMAT_VERSION
from kvtc.codec import Codec
from kvtc.errors import CalibrationError
from synthetic import LowRankSource, make_slice, rel_err

LAYOUT = KVLayout(layers=(0, 1, 2, 3), num_kv_heads=2, head_dim=32, dtype="float32")
P = LAYOUT.num_features  # 256


def _rows(seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ks = LowRankSource(P, decay=1e-3, noise=1e-3, seed=seed)
    vs = LowRankSource(P, decay=1e-2, noise=1e-3, seed=seed + 1)
    return [(ks.rows(1024), vs.rows(1024)) for _ in range(2)]


@pytest.fixture(scope="module")
def cal() -> Calibration:
    return fit_calibration(LAYOUT, _rows(), Recipe(ratios=(4, 16), dp_rows=256))


def _forged(cal: Calibration, tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    """The file of ``cal`` holding ``tensors``, its hash and checksum made to match as a forger would."""
    meta = cal._meta()
    meta["hash"] = cal.hash
    tensors = cal._tensors() if tensors is None else tensors
    meta["checksum"] = content_hash(meta, tensors, skip="checksum")
    return save(tensors, metadata={"kvtc": json.dumps(meta, sort_keys=True)})


def test_a_fitted_calibration_equals_its_saved_file(cal, tmp_path):
    assert cal.version == FORMAT_VERSION == 11
    back = Calibration.load(cal.save(tmp_path / "cal.safetensors"))
    assert back.hash == cal.hash and back.version == cal.version
    assert all(p.basis.dtype == torch.float16 for kind in ("keys", "values") for p in back.pcas[kind])
    mine, theirs = cal._tensors(), back._tensors()
    assert set(mine) == set(theirs)
    for name, t in mine.items():
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    assert back.to_bytes() == cal.to_bytes()
    # the fit's float32 bases rounded once: rows still orthonormal to float16's precision
    for kind in ("keys", "values"):
        b = cal.pcas[kind][0].basis.double()
        assert b.dtype == torch.float64 and torch.allclose(b @ b.T, torch.eye(b.shape[0], dtype=b.dtype), atol=3e-3)


def test_a_blob_of_the_fitted_calibration_decodes_with_the_file_as_with_it(cal, tmp_path):
    back = Calibration.load(cal.save(tmp_path / "cal.safetensors"))
    ks, vs = LowRankSource(P, decay=1e-3, noise=1e-3, seed=3), LowRankSource(P, decay=1e-2, noise=1e-3, seed=4)
    kv = make_slice(LAYOUT, ks.rows(300), vs.rows(300))
    blob = Codec(cal, ratio=16, sinks=2, window=4).encode(kv)
    a = Codec(cal, ratio=16, sinks=2, window=4).decode(blob)
    b = Codec(back, ratio=16, sinks=2, window=4).decode(blob)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert Codec(back, ratio=16, sinks=2, window=4).encode(kv) == blob
    assert rel_err(a.keys, kv.keys) < 0.2 and rel_err(a.values, kv.values) < 0.2


def test_the_file_stores_float16_bases(cal):
    data = cal.to_bytes()
    n = int.from_bytes(data[:8], "little")
    table = json.loads(data[8 : 8 + n])
    bases = [name for name in table if name.endswith(".basis")]
    assert bases and all(table[name]["dtype"] == "F16" for name in bases)
    for name in bases:
        start, end = table[name]["data_offsets"]
        assert end - start == 2 * cal.pcas[name.split(".")[0]][0].basis.numel()  # two bytes per basis entry


def test_the_constructor_rounds_once_and_leaves_the_callers_results_alone(cal):
    pcas = {kind: [dataclasses.replace(p, basis=p.basis.float()) for p in cal.pcas[kind]] for kind in cal.pcas}
    again = dataclasses.replace(cal, pcas=pcas)
    assert again.hash == cal.hash and again.pcas["keys"][0].basis.dtype == torch.float16
    assert all(p.basis.dtype == torch.float32 for kind in ("keys", "values") for p in pcas[kind])
    # the coder computes in float32
    mean, basis = cal.pcas["keys"][0].coder_basis(decode=True)
    assert mean.dtype == basis.dtype == torch.float32
    assert torch.equal(cal.pcas["keys"][0].coder_basis(False)[1], cal.pcas["keys"][0].basis.float())


def test_a_shard_keeps_float16_bases():
    layout = KVLayout(layers=(0, 1), num_kv_heads=2, head_dim=8, dtype="float32")
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(512, layout.num_features, generator=g)
    recipe = Recipe(ratios=(8,), dp_rows=128, grouping=PCAGrouping("head_shards", 2))
    cal = fit_calibration(layout, [(rows, rows * 0.5)], recipe)
    sub = cal.shard((1,))
    assert sub.pcas["keys"][0].basis.dtype == torch.float16
    assert Calibration.from_bytes(sub.to_bytes()).hash == sub.hash


def test_a_basis_of_another_dtype_is_refused(cal):
    tensors = cal._tensors()
    tensors["keys.0.basis"] = tensors["keys.0.basis"].float()
    with pytest.raises(CalibrationError) as e:
        Calibration.from_bytes(_forged(cal, tensors))
    msg = str(e.value)
    assert "'keys.0.basis'" in msg and "must be torch.float16" in msg and "stores its PCA bases as float16" in msg
    assert msg.endswith("recreate it with `kvtc calibrate`"), msg
    # one basis of the other dtype among right ones is refused too, naming it
    tensors = cal._tensors()
    tensors["values.0.basis"] = tensors["values.0.basis"].float()
    with pytest.raises(CalibrationError, match="'values.0.basis' must be torch.float16"):
        Calibration.from_bytes(_forged(cal, tensors))
    # the untouched file loads
    assert Calibration.from_bytes(cal.to_bytes()).hash == cal.hash


def test_a_basis_past_float16s_range_or_not_finite_is_refused(cal):
    pca = cal.pcas["keys"][0]
    for value in (1e5, float("inf"), float("nan")):
        basis = pca.basis.float()
        basis[0, 3] = value  # 1e5 rounds to inf in float16
        with pytest.raises(CalibrationError, match=r"'keys.0.basis'.*finite.*float16"):
            dataclasses.replace(cal, pcas={**cal.pcas, "keys": [dataclasses.replace(pca, basis=basis)]})
    tensors = cal._tensors()
    tensors["keys.0.basis"] = tensors["keys.0.basis"].clone()
    tensors["keys.0.basis"][1, 1] = float("inf")
    with pytest.raises(CalibrationError, match="'keys.0.basis'.*rebuild the calibration"):
        Calibration.from_bytes(_forged(cal, tensors))
