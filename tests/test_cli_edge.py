"""The command line at its edge: `kvtc --help` imports no torch, usage errors and bad inputs are one line with
exit code 2, checked before any model is loaded; files are opened only if regular, without blocking."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from kvtc import cli
from kvtc.cli import compress as compress_cmd


def _error_line(capsys, *argv) -> str:
    """Run the CLI in-process with the model loader disabled; return its one error line."""
    with pytest.raises(SystemExit) if argv and argv[0] == "__usage__" else _NoRaise():
        code = cli.main([str(a) for a in argv if a != "__usage__"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtc: error: ") and "Traceback" not in err, err
    if argv[0] != "__usage__":
        assert code == cli.EXIT_ERROR
    return lines[0]


class _NoRaise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """Every input here must be refused before a model (or the default calibration) is loaded."""

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr("kvtc.cli.common.load_model", refuse)
    monkeypatch.setattr("kvtc.cli.compress.load_model", refuse)
    monkeypatch.setattr("kvtc.cli.generate.load_model", refuse)
    monkeypatch.setattr("kvtc.assets.load_model", refuse)


def test_help_imports_no_torch():
    code = (
        "import sys\nfrom kvtc.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "for sub in ('calibrate', 'compress', 'generate', 'inspect', 'demo', 'eval'):\n"
        "    try:\n        main([sub, '--help'])\n    except SystemExit:\n        pass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "abc"], "whole number"),
        (["compress", "--prompt", "hi", "--out", "x.kvtc", "--ratio", "0.5"], "above 1"),
        (["compress", "--prompt", "hi", "--out", "x.kvtc", "--ratio", "nan"], "--ratio"),
        (["frobnicate"], "invalid choice"),
        (["compress", "--prompt", "hi"], "--out"),
    ],
)
def test_usage_errors_are_one_line(capsys, argv, fragment):
    assert fragment in _error_line(capsys, "__usage__", *argv)


def test_bad_inputs_are_refused_before_a_model_is_loaded(capsys, tmp_path):
    assert "holds no text" in _error_line(
        capsys, "compress", "--prompt", "  ", "--out", tmp_path / "o.kvtc", "--identity"
    )
    missing = tmp_path / "no" / "such" / "dir" / "o.kvtc"
    line = _error_line(capsys, "compress", "--prompt", "hello", "--out", missing, "--identity")
    assert "does not exist" in line and not missing.parent.exists()
    line = _error_line(capsys, "compress", "--prompt", "hello", "--out", tmp_path, "--identity")
    assert "is a directory" in line
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00garbage")
    assert "UTF-8" in _error_line(capsys, "compress", "--file", tmp_path / "bin.txt", "--out", tmp_path / "o.kvtc")


def test_non_regular_files_are_refused_without_blocking(capsys, tmp_path):
    fifo = tmp_path / "pipe.kvtc"
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(_error_line(capsys, "inspect", fifo)), daemon=True)
    t.start()
    t.join(20)
    assert done and "not a regular file" in done[0]
    assert "not a regular file" in _error_line(capsys, "inspect", "/dev/zero")
    assert "not a regular file" in _error_line(capsys, "generate", "--resume", tmp_path)


@pytest.mark.parametrize(
    "ids", [[1, 2, 3], [[1, 2], [3]], [["a", "b"]], [[-1, 2]], [[]], [[1.5, 2]], [[1] * ((1 << 20) + 1)]]
)
def test_malformed_token_records_are_refused(capsys, tmp_path, ids):
    from kvtc.codec import Codec
    from kvtc.codec.container import read_blob

    blob = read_blob(os.path.join(os.path.dirname(__file__), "fixtures", "sample.kvtc"))
    path = tmp_path / "s.kvtc"
    path.write_bytes(blob)
    import hashlib

    rec = {"format": compress_cmd.TOKENS_FORMAT, "version": 1, "blob_sha256": hashlib.sha256(blob).hexdigest(),
           "chat": False, "token_ids": ids}  # fmt: skip
    (tmp_path / ("s.kvtc" + compress_cmd.TOKENS_SUFFIX)).write_text(json.dumps(rec))
    assert Codec.inspect(blob)["mode"] == "kvtc"
    assert "token_ids" in _error_line(capsys, "generate", "--resume", path, "--calibration", "none.safetensors")
