"""The hostile-input campaigns of ``fuzz/`` (calibration files, stores, the command line), each for a few dozen
inputs: the calibration and store campaigns must find nothing; the CLI campaign must run and report (its
full property, exit 2 with one stderr line before any model is loaded, is what ``fuzz/campaign.py`` checks)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    mod_name = f"kvtc_fuzz_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, ROOT / "fuzz" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


def _summary(tally, mod) -> dict:
    return tally.summary(mod.TARGET, 1.0, 1.0)


def test_calibration_campaign_finds_nothing():
    mod = _load("fuzz_calibration")
    tally = mod.run(40, seed=7)
    s = _summary(tally, mod)
    # "slow" is left to the campaign (fuzz/campaign.py, on a quiet machine): today a plan of 100,000 segments
    # takes ~1 s to refuse on a loaded core (see test_a_million_segments_is_refused_quickly)
    others = {k: n for k, n in s["violations"].items() if k != "slow"}
    assert s["inputs"] == 40 and others == {}, s["violation_examples"]
    assert s["outcomes"]["CalibrationError"] > 20 and s["outcomes"].get("ok", 0) >= 2  # the two seeds load


def test_a_million_segments_is_refused_quickly():
    mod = _load("fuzz_calibration")
    from kvtc.calibration import Calibration
    from kvtc.errors import CalibrationError

    header, meta, body = mod.split(mod.FIXTURE.read_bytes())
    meta["plans"][next(iter(meta["plans"]))]["keys"][0]["segments"] = [[1, 2, 1]] * 1_000_000
    data = mod.join(header, json.dumps(meta), body)
    t0 = time.perf_counter()
    with pytest.raises(CalibrationError):
        Calibration.from_bytes(data)
    assert time.perf_counter() - t0 < 1.0


def test_calibration_seeds_include_scaled_calibration():
    mod = _load("fuzz_calibration")
    from kvtc.calibration import Calibration

    seeds = mod.build_seeds()
    assert Calibration.from_bytes(seeds["scaled"]).weighted and not Calibration.from_bytes(seeds["fixture"]).weighted


def test_store_campaign_finds_nothing(caplog):
    mod = _load("fuzz_store")
    tally = mod.run(60, seed=7, real_server=shutil.which("redis-server") is not None)
    s = _summary(tally, mod)
    assert s["inputs"] == 60 and s["violations"] == {}, s["violation_examples"]
    assert {"url", "file"} <= set(s["inputs_by_part"])
    if shutil.which("redis-server"):
        assert "redis" in s["inputs_by_part"] and s["skipped"] == []
    assert "url StoreError" in s["outcomes"] and "file ops ok" in s["outcomes"]


def test_cli_campaign_runs_and_reports(monkeypatch):
    mod = _load("fuzz_cli")
    monkeypatch.setattr(mod, "HANG_S", 2.0)
    cwd = Path.cwd()
    tally = mod.run(24, seed=7)
    s = _summary(tally, mod)
    assert Path.cwd() == cwd
    assert s["inputs"] == 24 and sum(s["outcomes"].values()) == 24
    assert sum(s["violations"].values()) == s["violation_count"] <= 24
    assert "kvtc.assets.load_model" in s["model_guard"]
    for e in s["violation_examples"]:
        assert (
            e["kind"]
            in (
                "exception",
                "traceback",
                "exit_code",
                "stderr_lines",
                "reached_model",
                "hang",
                "wrote_outside",
                "unescaped_output",
                "read_body",
            )
            and e["input"]
        )


def test_campaign_table_renders():
    mod = _load("campaign")
    c = {
        "campaign": "cli",
        "inputs": 5,
        "outcomes": {"exit 2": 5},
        "violations": {"stderr_lines": 2},
        "untyped_exceptions": 0,
        "hangs": 0,
        "slowest_input_s": 0.01,
        "skipped": [],
    }
    store = {**c, "campaign": "store", "violations": {}, "skipped": ["redis part: no redis-server on PATH"]}
    table = mod.render(
        {
            "campaigns": {"cli": c, "store": store},
            "date": "d",
            "machine": "m",
            "seconds": 1.0,
            "command": "python fuzz/campaign.py",
            "cli_hang_s": 20.0,
            "versions": {"kvtc": "0"},
        }
    )
    assert table.startswith(mod.START) and table.endswith(mod.END)
    assert "| CLI (`kvtc.cli.main`) | 5 | exit 2 5 | 0 | 0 | stderr_lines 2 | 0.010 s |" in table
    assert "no redis-server on PATH" in table
