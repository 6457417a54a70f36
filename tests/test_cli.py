"""The ``kvtc`` command line: compress -> inspect -> generate --resume on SmolLM2, and one-line typed errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fixtures_smollm2 import SMALL_CALIBRATION_TOKENS, heldout, small_calibration, small_calibration_path  # noqa: F401
from kvtc import cli
from kvtc.errors import KVTCError

CONTEXT_TOKENS = 600


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *fragments):
    assert code == cli.EXIT_ERROR
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtc: error: "), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0]


def test_inspect_missing_and_corrupt_files(capsys, tmp_path):
    code, _, err = run_cli(capsys, "inspect", tmp_path / "missing.kvtc")
    assert_one_line_error(code, err, "missing.kvtc")
    bad = tmp_path / "bad.kvtc"
    bad.write_bytes(b"KVTC" + b"\0" * 40)
    code, _, err = run_cli(capsys, "inspect", bad)
    assert_one_line_error(code, err, "bad.kvtc")


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(KVTCError):
        cli.main(["--debug", "inspect", str(tmp_path / "missing.kvtc")])


def test_module_entry_point_reports_errors_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvtc", "inspect", str(tmp_path / "none.kvtc")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("kvtc: error: ") and "Traceback" not in proc.stderr


def test_calibrate_refuses_to_replace_a_file_without_force(capsys, tmp_path):
    existing = tmp_path / "cal.safetensors"
    existing.write_bytes(b"a good file")
    code, _, err = run_cli(capsys, "calibrate", "--corpus", "sotu-pre2000", "--tokens", "2048", "--out", existing)
    assert_one_line_error(code, err, "--force")
    assert existing.read_bytes() == b"a good file"


def test_calibrate_help_names_the_default_ratio_ladder():
    from kvtc.calibration.recipe import DEFAULT_RATIOS
    from kvtc.cli.calibrate import RATIOS_HELP

    assert RATIOS_HELP.endswith("(default " + " ".join(f"{r:g}" for r in DEFAULT_RATIOS) + ")")


def test_calibrate_default_reuses_the_cached_calibration(capsys, tmp_path, monkeypatch, small_calibration_path):
    """`kvtc calibrate --tokens N` finds the default calibration cached for N tokens and reports it, building
    nothing (a cache holding the test calibration at the default's path: no model is loaded)."""
    import shutil

    from kvtc.calibration.fit import DEFAULT_RATIOS
    from kvtc.integrations.hf_calibrate import Recipe, default_calibration_path

    monkeypatch.setenv("KVTC_CACHE", str(tmp_path))
    cached = default_calibration_path(Recipe(tokens=SMALL_CALIBRATION_TOKENS))
    cached.parent.mkdir(parents=True)
    shutil.copyfile(small_calibration_path, cached)
    monkeypatch.setattr("kvtc.assets.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    code, out, _ = run_cli(capsys, "calibrate", "--tokens", SMALL_CALIBRATION_TOKENS)
    ratios = ", ".join(f"{r:g}" for r in DEFAULT_RATIOS)
    assert code == 0 and str(cached) in out and f"ratios {ratios}" in out
    assert "weighting: sensitivity (fisher)" in out and "bit budgets count" not in out


def test_compress_inspect_generate_resume(capsys, tmp_path, smollm2, heldout, small_calibration_path):
    _, tok = smollm2
    text_file = tmp_path / "speech.txt"
    text_file.write_text(tok.decode(heldout[0][0, :CONTEXT_TOKENS]))
    out = tmp_path / "speech.kvtc"
    code, stdout, err = run_cli(
        capsys,
        "compress",
        "--file",
        text_file,
        "--max-tokens",
        CONTEXT_TOKENS,
        "--calibration",
        small_calibration_path,
        "--ratio",
        16,
        "--out",
        out,
    )
    assert code == 0, err
    assert out.is_file() and "codec ratio" in stdout

    code, stdout, _ = run_cli(capsys, "inspect", out, "--json")
    info = json.loads(stdout)
    assert code == 0 and info["mode"] == "kvtc" and info["tokens"] == CONTEXT_TOKENS and info["target_ratio"] == "16"
    assert info["codec_ratio"] >= 16
    code, stdout, _ = run_cli(capsys, "inspect", out)
    assert code == 0 and "whole-cache ratio" in stdout

    code, stdout, err = run_cli(
        capsys,
        "generate",
        "--resume",
        out,
        "--calibration",
        small_calibration_path,
        "--max-new-tokens",
        12,
        "--compare",
    )
    assert code == 0, err
    resumed, _, exact = stdout.partition("--- from a full prefill ---")
    assert len(resumed.split()) >= 3 and len(exact.split()) >= 3
    assert "restored in" in err and "tokens identical" in err

    # a calibration that cannot be read is refused in one line, naming the fix
    code, _, err = run_cli(capsys, "generate", "--resume", out, "--calibration", tmp_path / "other.safetensors")
    assert_one_line_error(code, err, "other.safetensors", "kvtc calibrate")


def test_generate_resume_of_truncated_file(capsys, tmp_path, small_calibration_path):
    bad = tmp_path / "cut.kvtc"
    bad.write_bytes(b"KVTC\x01\x00")
    code, _, err = run_cli(capsys, "generate", "--resume", bad, "--calibration", small_calibration_path)
    assert_one_line_error(code, err, "cut.kvtc")


def test_calibrate_types_option_parses_names_and_refuses_unknown_ones():
    from kvtc.calibration.dp import DEFAULT_TYPES, PAPER_TYPES
    from kvtc.cli import parse_types
    from kvtc.errors import KVTCError
    from kvtc.quant import INT1S, INT2S, INT3

    assert parse_types("all") == DEFAULT_TYPES and parse_types("paper") == PAPER_TYPES
    assert parse_types("int3, int2s,int3") == (INT3, INT2S)
    # int1s is in the default set; naming it again adds nothing
    assert INT1S in DEFAULT_TYPES and parse_types("all,int1s") == DEFAULT_TYPES
    assert parse_types("paper,int1s") == (*PAPER_TYPES, INT1S)
    assert parse_types("paper,int2") == PAPER_TYPES
    for bad in ("int9", "drop", ",", "all,int9"):
        with pytest.raises(KVTCError, match="quantization type"):
            parse_types(bad)
