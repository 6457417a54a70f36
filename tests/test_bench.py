"""``kvtc bench``: the break-even arithmetic against hand-worked cases, the argument parsers, the command end to end
on a tiny random-weight model (and, marked slow, on the embedded SmolLM2), and one-line errors for bad arguments."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from fixtures_smollm2 import small_calibration_path  # noqa: F401
from kvtc import cli
from kvtc.bench.arith import (
    break_even_bandwidth,
    capacity_multiplier,
    compressed_vs_raw,
    compressed_vs_recompute,
    fastest,
    format_bandwidth,
    format_seconds,
    parse_bandwidth,
    parse_bandwidths,
    parse_ratios,
    parse_token_list,
    parse_tokens,
    ttft,
    winning_window,
)
from tiny_models import llama

# ---------------------------------------------------------------------- the arithmetic, by hand


def test_break_even_worked_example():
    """A 100 MB (1e8 bytes) 16-bit cache stored in 6.25 MB (16x); prefill 2.0 s, decode 0.5 s.

    * vs recompute: 6.25e6 / (2.0 - 0.5) = 4.1667e6 B/s: compression beats recompute on links above 4.17 MB/s;
    * vs raw: (1e8 - 6.25e6) / 0.5 = 1.875e8 B/s: compression beats raw transfer on links below 187.5 MB/s;
    * raw beats recompute above 1e8 / 2.0 = 5e7 B/s (50 MB/s);
    * so compression is the fastest path between 4.17 MB/s and 187.5 MB/s; capacity 1e8 / 6.25e6 = 16x.
    """
    be = break_even_bandwidth(1e8, 6.25e6, 2.0, 0.5)
    assert be.vs_recompute == pytest.approx(6.25e6 / 1.5) == pytest.approx(4_166_666.67)
    assert be.vs_raw == pytest.approx(1.875e8)
    assert be.raw_vs_recompute == pytest.approx(5e7)
    assert winning_window(be) == pytest.approx((4_166_666.67, 1.875e8))
    assert capacity_multiplier(1e8, 6.25e6) == 16


def test_ttft_worked_example():
    """Same cache, at three links:

    * 100 MB/s: recompute 2.0 s, raw 1e8/1e8 = 1.0 s, compressed 6.25e6/1e8 + 0.5 = 0.5625 s -> compressed;
    * 1 GB/s: recompute 2.0, raw 0.1, compressed 0.00625 + 0.5 = 0.50625 -> raw;
    * 1 MB/s: recompute 2.0, raw 100, compressed 6.25 + 0.5 = 6.75 -> recompute.
    """
    t = ttft(1e8, 6.25e6, 2.0, 0.5, 1e8)
    assert t == pytest.approx((2.0, 1.0, 0.5625)) and fastest(t) == "compressed"
    t = ttft(1e8, 6.25e6, 2.0, 0.5, 1e9)
    assert t == pytest.approx((2.0, 0.1, 0.50625)) and fastest(t) == "raw"
    t = ttft(1e8, 6.25e6, 2.0, 0.5, 1e6)
    assert t == pytest.approx((2.0, 100.0, 6.75)) and fastest(t) == "recompute"


def test_break_even_points_are_where_the_ttfts_meet():
    raw, stored, t_pre, t_dec = 3.2e9, 2.1e8, 4.7, 0.31
    be = break_even_bandwidth(raw, stored, t_pre, t_dec)
    at_star = ttft(raw, stored, t_pre, t_dec, be.vs_recompute)
    assert at_star.compressed == pytest.approx(at_star.recompute)
    at_2star = ttft(raw, stored, t_pre, t_dec, be.vs_raw)
    assert at_2star.compressed == pytest.approx(at_2star.raw)
    # just inside the window compressed wins; just outside it does not
    assert fastest(ttft(raw, stored, t_pre, t_dec, be.vs_recompute * 1.01)) == "compressed"
    assert fastest(ttft(raw, stored, t_pre, t_dec, be.vs_recompute * 0.99)) == "recompute"
    assert fastest(ttft(raw, stored, t_pre, t_dec, be.vs_raw * 1.01)) == "raw"


def test_break_even_edges():
    """Decode 3 s against a 2 s prefill: compression never beats recompute (None), whatever the link. A blob no
    smaller than the raw KV never beats raw transfer. A free decode beats raw at any bandwidth. A window that is empty
    (B* = 6.25e6 / (2.0 - 1.9) = 6.25e7 above B** = 9.375e7 / 1.9 = 4.93e7) is None."""
    assert compressed_vs_recompute(6.25e6, 2.0, 3.0) is None
    assert compressed_vs_recompute(6.25e6, 2.0, 2.0) is None
    assert compressed_vs_raw(1e8, 1e8, 0.5) is None
    assert compressed_vs_raw(1e8, 2e8, 0.5) is None
    assert compressed_vs_raw(1e8, 1e7, 0.0) == math.inf
    assert winning_window(break_even_bandwidth(1e8, 6.25e6, 2.0, 3.0)) is None
    be = break_even_bandwidth(1e8, 6.25e6, 2.0, 1.9)
    assert be.vs_recompute == pytest.approx(6.25e7) and be.vs_raw == pytest.approx(4.934e7, rel=1e-3)
    assert winning_window(be) is None
    for bad in ((0, 1, 1, 1), (1e8, -1, 1, 1), (1e8, 1, math.nan, 1), (1e8, 1, 1, -0.1)):
        with pytest.raises(ValueError):
            break_even_bandwidth(*bad)


def test_parsers():
    assert parse_bandwidth("10GB/s") == 1e10
    assert parse_bandwidth("100MB/s") == 1e8
    assert parse_bandwidth(" 1.5GiB/s ") == 1.5 * 2**30
    assert parse_bandwidth("25Gbit/s") == parse_bandwidth("25Gbps") == 25e9 / 8
    assert parse_bandwidths("10GB/s,1GB/s,100MB/s") == (1e10, 1e9, 1e8)
    for bad in ("nonsense", "10", "GB/s", "0GB/s", "-1GB/s", "10XB/s", ""):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)
    assert parse_tokens("2k") == 2048 and parse_tokens("32K") == 32768 and parse_tokens("1000") == 1000
    assert parse_token_list("8k,2k,2048") == (2048, 8192)
    for bad in ("0", "0k", "-1k", "2.5k", "k", "2k,,4k"):
        with pytest.raises(ValueError):
            parse_token_list(bad)
    assert parse_ratios("32,8,16x") == (8.0, 16.0, 32.0)
    for bad in ("abc", "1", "0.5", "8;16", "nan", "inf", "8,"):
        with pytest.raises(ValueError):
            parse_ratios(bad)
    assert format_bandwidth(None) == "never" and format_bandwidth(math.inf) == "any"
    assert format_bandwidth(1.875e8) == "188 MB/s" and format_bandwidth(4_166_666.7) == "4.17 MB/s"
    assert format_seconds(0.5625) == "562 ms" and format_seconds(12.34) == "12.3 s"


# ---------------------------------------------------------------------- the command


def run_cli(capsys, *argv):
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err) -> str:
    assert code == cli.EXIT_ERROR
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtc: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """tests/tiny_models.py's two-layer Llama (2 KV heads of 16, at most 2,048 positions) as a config.json."""
    d = tmp_path_factory.mktemp("tiny-llama")
    llama().save_pretrained(d)
    return d / "config.json"


@pytest.fixture(scope="module")
def tiny_run(tiny_config, tmp_path_factory):
    """``kvtc bench`` on the tiny random-weight model: contexts 128, 256 (and 4K, above its 2,048 positions),
    ratios 8 and 16, two links, with the plot. Returns (exit code, stdout, stderr, bench.json, out dir)."""
    out = tmp_path_factory.mktemp("bench")
    argv = [
        "bench",
        "--random-weights",
        str(tiny_config),
        "--contexts",
        "128,256,4k",
        "--ratios",
        "8,16",
        "--link",
        "1GB/s,10MB/s",
        "--repeats",
        "1",
        "--calibration-tokens",
        "2048",
        "--out",
        str(out),
        "--plot",
        "--no-progress",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "kvtc", *argv], capture_output=True, text=True, timeout=600, env=_env()
    )
    data = json.loads((out / "bench.json").read_text()) if (out / "bench.json").is_file() else None
    return proc.returncode, proc.stdout, proc.stderr, data, out


def _env():
    import os

    return {**os.environ, "OMP_NUM_THREADS": "2"}


def test_bench_end_to_end_tiny(tiny_run):
    code, out, err, data, folder = tiny_run
    assert code == 0, err
    assert {"model", "machine", "calibration", "config", "definitions", "prefill", "codec", "quality"} <= set(data)
    assert data["random_weights"] and data["config"]["contexts"] == [128, 256]
    assert any("4K" in n and "2048" in n for n in data["notes"])  # the model's maximum capped the list
    assert [p["context"] for p in data["prefill"]] == [128, 256]
    assert len(data["codec"]) == 4 and {(r["context"], r["ratio"]) for r in data["codec"]} == {
        (n, r) for n in (128, 256) for r in (8.0, 16.0)
    }
    prefill = {p["context"]: p["prefill_s"] for p in data["prefill"]}
    for r in data["codec"]:
        raw, stored, t_dec, t_pre = r["raw_bytes"], r["stored_bytes"], r["decode_s"], prefill[r["context"]]
        assert raw == r["context"] * 2 * 2 * 16 * 2 * 2  # tokens x layers x heads x head_dim x (K, V) x 2 bytes
        assert 0 < stored < raw and r["capacity_multiplier"] == pytest.approx(raw / stored)
        assert r["encode_GBps"] == pytest.approx(raw / r["encode_s"] / 1e9)
        assert r["decode_GBps"] == pytest.approx(raw / t_dec / 1e9)
        be = r["break_even"]
        if t_dec < t_pre:
            assert be["vs_recompute_Bps"] == pytest.approx(stored / (t_pre - t_dec))
        else:
            assert be["vs_recompute_Bps"] is None
        assert be["vs_raw_Bps"] == pytest.approx((raw - stored) / t_dec)
        assert [x["link_Bps"] for x in r["ttft"]] == [1e9, 1e7]
        for x in r["ttft"]:
            assert x["recompute_s"] == pytest.approx(t_pre)
            assert x["raw_s"] == pytest.approx(raw / x["link_Bps"])
            assert x["compressed_s"] == pytest.approx(stored / x["link_Bps"] + t_dec)
            assert x["fastest"] == min(("recompute", "raw", "compressed"), key=lambda k: x[f"{k}_s"])
    assert set(data["quality"]["by_ratio"]) == {"8", "16"}
    assert "random weights" in data["quality"]["source"]
    assert all(q["kl"] == "not measured; run kvtc eval --quick" for q in data["quality"]["by_ratio"].values())
    assert len(data["recommendation"]) == 2 and all("256-token contexts" in x for x in data["recommendation"])
    assert "recommendation: at 1GB/s" in out and "time to first token" in out
    assert (folder / "bench.png").stat().st_size > 1000


def test_cli_lists_bench():
    code = (
        "import sys\nfrom kvtc.cli import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--random-weights" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--ratios", "abc"], "not a compression ratio"),
        (["--ratios", "8;16"], "not a compression ratio"),
        (["--link", "nonsense"], "not a link bandwidth"),
        (["--contexts", "0"], "from 1 to"),
        (["--contexts", "2k,,4k"], "comma-separated"),
        (["--repeats", "0"], "repetitions"),
        (["--calibration-tokens", "10"], "rows"),
        (["--device", "tpu"], "cpu or cuda"),
        (["--random-weights", "tiny", "--model", "gemma3"], "not both"),
        (["--random-weights", "no-such-preset"], "neither a preset"),
    ],
)
def test_bad_arguments_are_one_line(capsys, monkeypatch, argv, fragment):
    monkeypatch.setattr("kvtc.assets.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    code, _, err = run_cli(capsys, "bench", *argv)
    assert fragment in one_line_error(code, err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("kvtc.assets.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    code, _, err = run_cli(capsys, "bench", "--device", "cuda")
    assert "no CUDA GPU" in one_line_error(code, err)


def test_plot_without_matplotlib_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr("kvtc.assets.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    code, _, err = run_cli(capsys, "bench", "--plot")
    assert "pip install matplotlib" in one_line_error(code, err)


def test_bench_on_the_embedded_default(capsys, tmp_path, smollm2_dir, small_calibration_path):  # noqa: F811
    """The real path: SmolLM2, its default calibration (token map: the encoder takes the ids), one short context."""
    code, out, err = run_cli(
        capsys,
        "bench",
        "--calibration",
        small_calibration_path,
        "--contexts",
        "256",
        "--ratios",
        "16",
        "--repeats",
        "1",
        "--out",
        tmp_path,
        "--no-progress",
    )
    assert code == 0, err
    data = json.loads((tmp_path / "bench.json").read_text())
    (row,) = data["codec"]
    assert row["raw_bytes"] == 256 * 30 * 3 * 64 * 2 * 2 and row["stored_bytes"] < row["raw_bytes"]
    q = data["quality"]["by_ratio"]["16"]
    assert set(q["predicted_relative_error"]) == {"keys", "values"}
    assert "predicted_relative_error" in data["quality"]["source"] and "recommendation: at 1GB/s" in out
