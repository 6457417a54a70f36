"""How a calibration stores its PCA bases: float16 from format version 10, rounded when the calibration is made.

A fitted calibration holds what its file will hold (the same tensors, the same hash), so a blob encoded with it
decodes with the saved file; the file is about half a float32 one's size; older files (float32 bases, versions
1-9) still load, keep their hash and are saved in their version again; a basis whose dtype contradicts the file's
version is refused.
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
from kvtc.calibration.meta import HALF_BASIS_VERSION, READ_VERSIONS, read_meta, stored_basis_dtype
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


def _wide(cal: Calibration) -> Calibration:
    """The same calibration with float32 bases, as a file of version 4-9 holds them."""
    return dataclasses.replace(cal, basis_dtype=torch.float32)


def _forged(cal: Calibration, version: int, tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    """The file of ``cal`` claiming ``version`` (and holding ``tensors``), its hash and checksum made to match as a
    forger would: only the bases' dtype contradicts the version."""
    meta = cal._meta()
    meta["version"] = version
    meta["hash"] = cal.hash
    tensors = cal._tensors() if tensors is None else tensors
    meta["checksum"] = content_hash(meta, tensors, skip="checksum")
    return save(tensors, metadata={"kvtc": json.dumps(meta, sort_keys=True)})


def test_a_fitted_calibration_equals_its_saved_file(cal, tmp_path):
    assert cal.basis_dtype == torch.float16 and cal.version == HALF_BASIS_VERSION
    back = Calibration.load(cal.save(tmp_path / "cal.safetensors"))
    assert back.hash == cal.hash and back.version == cal.version and back.basis_dtype == torch.float16
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
    # the float16 bases cost nothing measurable against the float32 ones at the same plans
    wide = Codec(_wide(cal), ratio=16, sinks=2, window=4)
    w = wide.decode(wide.encode(kv))
    for got, ref, x in ((a.keys, w.keys, kv.keys), (a.values, w.values, kv.values)):
        assert rel_err(got, x) == pytest.approx(rel_err(ref, x), rel=1e-2)


def test_the_file_stores_float16_bases_in_about_half_the_bytes(cal):
    half, full = cal.to_bytes(), _wide(cal).to_bytes()
    n = int.from_bytes(half[:8], "little")
    table = json.loads(half[8 : 8 + n])
    bases = [name for name in table if name.endswith(".basis")]
    assert bases and all(table[name]["dtype"] == "F16" for name in bases)
    elements = sum(cal.pcas[kind][0].basis.numel() for kind in ("keys", "values"))
    assert abs((len(full) - len(half)) - 2 * elements) < 64  # two bytes fewer per basis entry, the rest the same
    assert len(half) < 0.56 * len(full), (len(half), len(full))


def test_the_constructor_rounds_once_and_leaves_the_callers_results_alone(cal):
    wide = _wide(cal)
    assert all(p.basis.dtype == torch.float32 for kind in ("keys", "values") for p in wide.pcas[kind])
    pcas = {kind: list(wide.pcas[kind]) for kind in ("keys", "values")}
    again = dataclasses.replace(wide, pcas=pcas, basis_dtype=None)  # None: float16, as a fit's calibration
    assert again.basis_dtype == torch.float16 and again.hash == cal.hash
    assert all(p.basis.dtype == torch.float32 for kind in ("keys", "values") for p in pcas[kind])
    # a float16 basis made float32 and back is the same calibration
    assert dataclasses.replace(cal).hash == cal.hash
    # the coder computes in float32 whatever the calibration holds
    for c in (cal, wide):
        mean, basis = c.pcas["keys"][0].coder_basis(decode=True)
        assert mean.dtype == basis.dtype == torch.float32
    assert torch.equal(cal.pcas["keys"][0].coder_basis(False)[1], cal.pcas["keys"][0].basis.float())


def test_an_older_file_keeps_its_float32_bases_hash_and_version(cal, tmp_path):
    wide = _wide(cal)
    assert wide.version < HALF_BASIS_VERSION and wide.hash != cal.hash  # another calibration: other bases
    back = Calibration.load(wide.save(tmp_path / "old.safetensors"))
    assert back.basis_dtype == torch.float32 and back.hash == wide.hash and back.version == wide.version
    assert back.pcas["keys"][0].basis.dtype == torch.float32 and back.to_bytes() == wide.to_bytes()
    # made anew (as a user would, to shrink it): float16 bases, version 10, the fitted calibration's hash
    anew = dataclasses.replace(back, basis_dtype=torch.float16)
    assert anew.version == HALF_BASIS_VERSION and anew.hash == cal.hash
    with pytest.raises(CalibrationError, match="legacy"):
        dataclasses.replace(back, legacy=True, basis_dtype=torch.float16)
    with pytest.raises(CalibrationError, match="basis_dtype"):
        dataclasses.replace(cal, basis_dtype=torch.bfloat16)


def test_a_shard_keeps_its_calibrations_basis_dtype():
    layout = KVLayout(layers=(0, 1), num_kv_heads=2, head_dim=8, dtype="float32")
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(512, layout.num_features, generator=g)
    recipe = Recipe(ratios=(8,), dp_rows=128, grouping=PCAGrouping("head_shards", 2))
    cal = fit_calibration(layout, [(rows, rows * 0.5)], recipe)
    for c, dtype in ((cal, torch.float16), (_wide(cal), torch.float32)):
        sub = c.shard((1,))
        assert sub.basis_dtype == dtype and sub.pcas["keys"][0].basis.dtype == dtype
        assert Calibration.from_bytes(sub.to_bytes()).hash == sub.hash


@pytest.mark.parametrize("stored", [torch.float16, torch.float32])
def test_a_basis_whose_dtype_contradicts_the_version_is_refused(cal, stored):
    wide = _wide(cal)
    if stored == torch.float16:  # float16 bases in a file that claims an older version (float32 bases)
        data, want = _forged(cal, wide.version), "float32"
        versions = f"1 to {HALF_BASIS_VERSION - 1}"
    else:  # float32 bases in a version-10 file
        data, want = _forged(wide, HALF_BASIS_VERSION), "float16"
        versions = f"{HALF_BASIS_VERSION} or later"
    with pytest.raises(CalibrationError) as e:
        Calibration.from_bytes(data)
    msg = str(e.value)
    assert "'keys.0.basis'" in msg and f"must be torch.{want}" in msg and versions in msg, msg
    assert msg.endswith("recreate it with `kvtc calibrate`"), msg
    # one basis of the other dtype among right ones is refused too, naming it
    tensors = cal._tensors()
    tensors["values.0.basis"] = tensors["values.0.basis"].float()
    with pytest.raises(CalibrationError, match="'values.0.basis' must be torch.float16"):
        Calibration.from_bytes(_forged(cal, HALF_BASIS_VERSION, tensors))
    # the untouched files load
    assert Calibration.from_bytes(cal.to_bytes()).hash == cal.hash
    assert Calibration.from_bytes(wide.to_bytes()).hash == wide.hash


def test_an_older_reader_refuses_a_version_10_file_by_its_version(cal):
    data = cal.to_bytes()
    n = int.from_bytes(data[:8], "little")
    raw = json.loads(data[8 : 8 + n])["__metadata__"]["kvtc"]
    assert read_meta(raw, "new")["version"] == HALF_BASIS_VERSION in READ_VERSIONS
    from kvtc.calibration.meta import validate_meta

    with pytest.raises(CalibrationError, match="version 10 is not supported by this kvtc.*upgrade kvtc"):
        validate_meta(json.loads(raw), "new", tuple(v for v in READ_VERSIONS if v < HALF_BASIS_VERSION))
    assert stored_basis_dtype(HALF_BASIS_VERSION) == torch.float16
    assert {stored_basis_dtype(v) for v in READ_VERSIONS if v < HALF_BASIS_VERSION} == {torch.float32}


def test_a_basis_past_float16s_range_or_not_finite_is_refused(cal):
    pca = _wide(cal).pcas["keys"][0]
    for value in (1e5, float("inf"), float("nan")):
        basis = pca.basis.clone()
        basis[0, 3] = value  # 1e5 rounds to inf in float16
        with pytest.raises(CalibrationError, match=r"'keys.0.basis'.*finite.*float16"):
            dataclasses.replace(cal, pcas={**cal.pcas, "keys": [dataclasses.replace(pca, basis=basis)]})
    tensors = cal._tensors()
    tensors["keys.0.basis"] = tensors["keys.0.basis"].clone()
    tensors["keys.0.basis"][1, 1] = float("inf")
    with pytest.raises(CalibrationError, match="'keys.0.basis'.*rebuild the calibration"):
        Calibration.from_bytes(_forged(cal, HALF_BASIS_VERSION, tensors))
