"""The command line on hostile files: `kvtc inspect` reads only the header of a multi-GB blob, and every string
from a blob or a calibration is printed escaped (no terminal escape sequence, carriage return, bidi control or
lone surrogate reaches the terminal, and none ends in an untyped error)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

import kvtc
from kvtc import cli
from kvtc.codec import container
from kvtc.codec.header import Section
from kvtc.textsafe import printable

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SAMPLE = FIXTURES / "sample.kvtc"
#: what a hostile header may carry: clear the screen and retitle the terminal, rewrite the line, reverse the
#: text's direction, a lone surrogate (JSON "\ud800"), a C1 CSI
HOSTILE = {
    "escape": "\x1b[2J\x1b]0;pwned\x07",
    "carriage_return": "ok\rEVIL",
    "bidi": "abc\u202edef",
    "surrogate": "x\ud800y",
    "c1_csi": "\x9b31mred",
}
ALL_HOSTILE = "".join(HOSTILE.values())
#: subprocesses import the kvtc this test imports
ENV = {**os.environ, "PYTHONPATH": str(Path(kvtc.__file__).resolve().parent.parent)}


def forge(path: Path, **fields) -> Path:
    """The fixture blob with header ``fields`` replaced (``sections`` included: same sizes, other names or CRCs),
    written by kvtc's own writer (canonical JSON, header CRC recomputed), its sections' bytes kept."""
    blob = SAMPLE.read_bytes()
    header, body = container.read_header(blob)
    path.write_bytes(container.prefix_and_header(dataclasses.replace(header, **fields)) + blob[body:])
    return path


def assert_safe(text: str) -> None:
    """Nothing a terminal acts on: no control character but newline, no format (bidi) character, no surrogate."""
    text.encode("utf-8")
    bad = [ch for ch in text if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf", "Cs")]
    assert not bad, bad


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------ escaping
@pytest.mark.parametrize("kind", [*HOSTILE, "all"])
def test_inspect_escapes_a_hostile_model_id(capsys, tmp_path, kind):
    hostile = ALL_HOSTILE if kind == "all" else HOSTILE[kind]
    path = forge(tmp_path / "m.kvtc", model_id=hostile)
    code, out, err = run(capsys, "inspect", path)
    assert code == 0, err
    assert_safe(out)
    assert_safe(err)
    assert "Traceback" not in err and "internal error" not in err
    line = next(ln for ln in out.splitlines() if ln.startswith("  model "))
    assert line.startswith("  model " + printable(hostile) + ";")


def test_inspect_escapes_the_calibration_hash_section_and_backend_names(capsys, tmp_path):
    blob = SAMPLE.read_bytes()
    header, _ = container.read_header(blob)
    sections = list(header.sections)
    coded = next(i for i, s in enumerate(sections) if s.coded < s.raw)  # a raw section must say "raw"
    sections[coded] = dataclasses.replace(sections[coded], backend="\x1b[5m\u202e")
    sections[0 if coded else 1] = dataclasses.replace(sections[0 if coded else 1], name="\x1b[31m\r\ud800")
    path = forge(tmp_path / "s.kvtc", sections=sections, calibration="\x1b]0;x\x07\u202e\ud800")
    code, out, err = run(capsys, "inspect", path)
    assert code == 0, err
    assert_safe(out)
    assert "\\x1b[31m\\x0d\\ud800" in out and "\\x1b[5m\\u202e" in out and "calibration \\x1b]0;x\\x07\\u202e" in out


def test_inspect_json_escapes_and_round_trips(capsys, tmp_path):
    path = forge(tmp_path / "j.kvtc", model_id=ALL_HOSTILE)
    code, out, err = run(capsys, "inspect", path, "--json")
    assert code == 0, err
    assert out.isascii() and "\x1b" not in out and "\r" not in out
    assert json.loads(out)["model_id"] == ALL_HOSTILE


def test_inspect_in_a_terminal_process(tmp_path):
    """As a user runs it: a separate process writing to a pipe in the locale's encoding."""
    path = forge(tmp_path / "p.kvtc", model_id=ALL_HOSTILE)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtc", "inspect", str(path)], capture_output=True, timeout=120, env=ENV
    )
    assert proc.returncode == 0, proc.stderr
    for seq in (b"\x1b", b"\r", "\u202e".encode(), b"\xc2\x9b"):
        assert seq not in proc.stdout and seq not in proc.stderr
    assert b"Traceback" not in proc.stderr


def test_printing_never_raises_on_an_ascii_terminal(tmp_path):
    path = forge(tmp_path / "a.kvtc", model_id="modèle 日本")
    env = {**ENV, "PYTHONIOENCODING": "ascii"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvtc", "inspect", str(path)], capture_output=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert b"model mod\\xe8le \\u65e5\\u672c;" in proc.stdout


def test_error_messages_are_escaped(capsys, tmp_path, monkeypatch):
    """A typed error may quote a blob (a section name, a model id): its one line is escaped, never raw."""
    from kvtc.errors import FormatError

    def hostile(*a, **k):
        raise FormatError(f"model {ALL_HOSTILE} does not fit\nthe second line")

    monkeypatch.setattr("kvtc.codec.Codec.inspect", hostile)
    code, out, err = run(capsys, "inspect", SAMPLE)
    assert code == cli.EXIT_ERROR
    assert_safe(err)
    assert err.startswith("kvtc: error: ") and err.count("\n") == 1
    assert "model \\x1b[2J" in err and "\\ud800" in err and "fit the second line" in err


def test_verify_streams_the_sections_and_names_a_bad_one_escaped(capsys, tmp_path):
    blob = SAMPLE.read_bytes()
    header, _ = container.read_header(blob)
    good = tmp_path / "good.kvtc"
    good.write_bytes(blob)
    code, out, err = run(capsys, "inspect", good, "--verify")
    assert code == 0 and f"checksums: all {len(header.sections)} sections match" in out, err
    sections = list(header.sections)
    sections[-1] = dataclasses.replace(sections[-1], name="\x1b[2Jlast", crc32=sections[-1].crc32 ^ 1)
    bad = forge(tmp_path / "bad.kvtc", sections=sections)
    code, out, err = run(capsys, "inspect", bad)  # without --verify: the sections are not read
    assert code == 0, err
    code, out, err = run(capsys, "inspect", bad, "--verify")
    assert code == cli.EXIT_ERROR and "section \\x1b[2Jlast: checksum mismatch" in err
    assert_safe(err)


# ------------------------------------------------------------------------------------------ calibration
def test_calibrate_summary_escapes_a_hostile_calibration(capsys, tmp_path, monkeypatch):
    """`kvtc calibrate` prints the calibration's model id and free-form metadata (corpus, stats): escaped, and a
    field of the wrong type is shown, not an untyped error."""
    from kvtc.calibration.artifact import Calibration

    cal = Calibration.load(FIXTURES / "calibration.safetensors")
    cal.model_id = ALL_HOSTILE
    cal.corpus = {
        "sensitivity": {"method": "\x1b[2J\u202e", "resolution": "\ud800"},
        "token_map": {"gain": {"keys": "\x1b[31m", "values": [1]}},
    }
    cal.stats = {"seconds": {"total": "\x1b]0;pwned\x07"}, "notes": {"rate": ["\x1b"]}}
    path = cal.save(tmp_path / "hostile.safetensors")
    assert Calibration.load(path).model_id == ALL_HOSTILE
    monkeypatch.setattr("kvtc.integrations.hf_calibrate.default_calibration", lambda *a, **k: path)
    code, out, err = run(capsys, "calibrate")
    assert code == 0, err
    assert_safe(out)
    assert_safe(err)
    assert "  model " + printable(ALL_HOSTILE) + "," in out
    assert "built in \\x1b]0;pwned\\x07 s" in out


# ------------------------------------------------------------------------------------------ a huge blob
MEASURE = r"""
import json, resource, sys, time
import kvtc
from kvtc import cli
import kvtc.codec  # imported before the clock starts: torch's import is not what is measured

def rchar():
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration):
        return None

rss0, r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rchar()
t0 = time.perf_counter()
code = cli.main(sys.argv[1:])
seconds = time.perf_counter() - t0
rss1, r1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rchar()
sys.stderr.write("\n" + json.dumps({"code": code, "seconds": seconds, "rss_growth_kb": rss1 - rss0,
                                     "read_bytes": None if r0 is None else r1 - r0}) + "\n")
"""


def sparse_blob(path: Path, total: int) -> int:
    """A sparse file of about ``total`` bytes: the fixture's header (via kvtc's writer) declaring one section of
    ``total`` bytes, its body a hole. Returns the size the header accounts for."""
    blob = SAMPLE.read_bytes()
    header, _ = container.read_header(blob)
    # a batch and token count whose bound admits a section that large
    header = dataclasses.replace(
        header, batch=16, tokens=1 << 20, sections=[Section("keys.0.int2", "raw", total, total, 0)]
    )
    head = container.prefix_and_header(header)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + total)
    return len(head) + total


def measure(*argv) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, *map(str, argv)], capture_output=True, text=True, timeout=300, env=ENV
    )
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("{"), proc.stdout + proc.stderr
    return json.loads(lines[-1]), proc.stdout + proc.stderr


def test_inspect_reads_only_the_header_of_a_3_gib_blob(tmp_path):
    path = tmp_path / "huge.kvtc"
    size = sparse_blob(path, 3 << 30)
    assert os.stat(path).st_size == size and os.stat(path).st_blocks * 512 < 1 << 20  # sparse: no body on disk
    m, out = measure("inspect", path)
    assert m["code"] == 0, out
    assert "3.22 GB" in out and "keys.0.int2" in out
    assert m["seconds"] < 1.0, m
    assert m["rss_growth_kb"] < 64 << 10, m  # reading the body would add 3 GB
    if m["read_bytes"] is not None:
        assert m["read_bytes"] < 4 << 20, m  # the header only (and this process's own /proc reads)
    # a truncated or extended file is refused as quickly, from its size alone
    for delta, what in ((-1, "truncated"), (1, "trailing bytes")):
        os.truncate(path, size + delta)
        m, out = measure("inspect", path)
        assert m["code"] == cli.EXIT_ERROR and what in out and m["seconds"] < 1.0, (m, out)


# ------------------------------------------------------------------------------------------ integration logs
def test_vllm_worker_logs_escape_store_keys_request_ids_and_errors(caplog):
    """What the connector logs about a stored chunk (its key, the request id, the error the codec raised on a blob)
    is escaped: a hostile store or blob cannot write to the engine's terminal or log."""
    import logging
    import types

    from kvtc.errors import FormatError
    from kvtc.integrations.vllm.metadata import LoadJob
    from kvtc.integrations.vllm.worker import WorkerSide

    side = types.SimpleNamespace(tally=types.SimpleNamespace(add=lambda **k: None), _unsaved=lambda key: None)
    side._forget = lambda key: None
    job = LoadJob(req_id="req\x1b[2J\ud800", block_ids=[[0]], start=0, stop=16, keys=["k"], first_chunk=0)
    with caplog.at_level(logging.WARNING, logger="kvtc.vllm"):
        WorkerSide._saved(side, "\x1b]0;key\x07\u202e", None, {}, f"FormatError: section {ALL_HOSTILE}: bad")
        WorkerSide._refuse(side, job, "\r\ud800key", 3, FormatError(f"model {ALL_HOSTILE}\nsecond line"))
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtc.vllm"]
    assert len(lines) == 2
    for line in lines:
        assert_safe(line)
        assert "\n" not in line and "\\x1b" in line
    assert "request req\\x1b[2J\\ud800" in lines[1] and "(key \\x0d\\ud800key…)" in lines[1]


def test_eval_report_escapes_what_comes_from_the_calibration_and_peers():
    from kvtc.eval import report

    result = {
        "config": {"windows": 1, "context": 512, "continuation": 64, "sinks": 4, "window": 128},
        "model": "m\x1b[2J",
        "texts": ["t\u202e"],
        "calibration": {"name": "c\x1b]0;x\x07.safetensors", "samples": "\ud800", "corpus": {"name": ALL_HOSTILE}},
        "storage_roundtrip": [],
        "skipped": {"quanto\r": f"import failed: {ALL_HOSTILE}"},
        "machine": {"cpu": "cpu\x1b[5m", "gpu": "\u202egpu"},
        "timings_s": {"total": 60.0},
    }
    md = report.markdown(result)
    assert_safe(md)
    assert "Model m\\x1b[2J," in md and "corpus \\x1b[2J" in md and "Skipped quanto\\x0d: import failed:" in md
