"""The hostile-input campaigns, all four, with one combined result: the container (``fuzz_container.py`` in
``--procs`` processes with distinct seeds), calibration files, stores and the command line.

Writes ``benchmarks/results/fuzz_campaigns.json`` and the table between ``<!-- fuzz_campaigns:start -->`` and
``<!-- fuzz_campaigns:end -->`` in BENCHMARKS.md. Needs Python with torch, numpy, safetensors, zstandard and
kvtc importable; the store campaign's Redis parts also need the ``redis`` package (and ``redis-server`` on
PATH for the real-server part), and say in the table what they skipped.

    PYTHONPATH=src python fuzz/campaign.py --procs 12                   # the full campaign (defaults below)
    PYTHONPATH=src python fuzz/campaign.py --runs-per-campaign 200 --procs 2 --no-benchmarks   # a smoke run

Exit status 1 when any campaign reports a violation (or a process died).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results" / "fuzz_campaigns.json"
BENCHMARKS = ROOT / "BENCHMARKS.md"
START, END = "<!-- fuzz_campaigns:start -->", "<!-- fuzz_campaigns:end -->"
OLD_START, OLD_END = "<!-- fuzz_container:start -->", "<!-- fuzz_container:end -->"
DEFAULT_RUNS = {"container": 1_000_000, "calibration": 1_000_000, "store": 20_000, "cli": 1_000}
#: exit status of fuzz_container / fuzz_calibration when their watchdog caught an input running past its limit
HANG_EXIT = 70


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
        return m.group(1).strip() if m else platform.processor()
    except OSError:
        return platform.processor() or "?"


def machine() -> str:
    return f"{_cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}"


def _launch(script: str, args: list[str], out: Path, log: Path) -> tuple[subprocess.Popen, Path, list[str]]:
    cmd = [sys.executable, str(HERE / script), *args, "--out", str(out)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, cwd=ROOT)
    return proc, out, cmd


def _read(out: Path, proc: subprocess.Popen, log: Path) -> dict[str, Any]:
    if out.exists():
        return json.loads(out.read_text())
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    return {"died": True, "returncode": proc.returncode, "hang": proc.returncode == HANG_EXIT, "log_tail": tail}


def combine_container(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary of the container processes: sums, maxima, and the hangs (a process its watchdog ended)."""
    ok = [p for p in parts if not p.get("died")]
    died = [p for p in parts if p.get("died")]
    exc: Counter = Counter()
    viol: Counter = Counter()
    for p in ok:
        exc.update(p["exceptions_by_type"])
        viol.update(p["violations"])
    hangs = sum(1 for p in died if p.get("hang"))
    slowest = max(ok, key=lambda p: p["slowest_input_s"], default=None)
    return {
        "campaign": "container",
        "target": ok[0]["target"] if ok else "",
        "processes": len(parts),
        "seeds": [p["seed"] for p in ok],
        "inputs": sum(p["inputs"] for p in ok),
        "seconds": max((p["seconds"] for p in ok), default=0),
        "outcomes": dict(exc.most_common()),
        "header_valid_inputs": sum(p["header_valid_inputs"] for p in ok),
        "decoded_inputs": sum(p["decoded_inputs"] for p in ok),
        "violations": dict(viol.most_common()),
        "violation_count": sum(viol.values()) + len(died),
        "untyped_exceptions": viol.get("exception", 0),
        "hangs": hangs,
        "processes_died": [{k: v for k, v in p.items() if k != "died"} for p in died],
        "violation_examples": [e for p in ok for e in p["violation_examples"]][:20],
        "slowest_input_s": slowest["slowest_input_s"] if slowest else None,
        "slowest_input": slowest["slowest_input"] if slowest else None,
        "time_limit_s": ok[0]["time_limit_s"] if ok else None,
        "peak_traced_alloc_bytes": max((p["peak_traced_alloc_bytes"] for p in ok), default=0),
        "max_traced_alloc_fraction_of_bound": max((p["max_traced_alloc_fraction_of_bound"] for p in ok), default=0),
        "peak_rss_growth_bytes": max((p["peak_rss_growth_bytes"] for p in ok), default=0),
        "max_rss_growth_fraction_of_bound": max((p["max_rss_growth_fraction_of_bound"] for p in ok), default=0),
        "skipped": [],
        "versions": ok[0]["versions"] if ok else {},
    }


def combine_tallies(parts: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One summary of a campaign run in several processes with distinct seeds (the calibration campaign)."""
    ok = [p for p in parts if not p.get("died")]
    died = [p for p in parts if p.get("died")]
    if len(parts) == 1:
        return _other(parts[0], name)
    outcomes: Counter = Counter()
    viol: Counter = Counter()
    by_mut: Counter = Counter()
    for p in ok:
        outcomes.update(p.get("outcomes", {}))
        viol.update(p.get("violations", {}))
        by_mut.update(p.get("violations_by_mutator", {}))
    slowest = max(ok, key=lambda p: p.get("slowest_input_s") or 0, default=None)
    return {
        "campaign": name,
        "processes": len(parts),
        "seeds": [p.get("seed") for p in ok],
        "inputs": sum(p.get("inputs", 0) for p in ok),
        "seconds": max((p.get("seconds", 0) for p in ok), default=0),
        "outcomes": dict(outcomes.most_common()),
        "violations": dict(viol.most_common()),
        "violation_count": sum(viol.values()) + len(died),
        "untyped_exceptions": viol.get("exception", 0),
        "hangs": viol.get("hang", 0) + sum(1 for p in died if p.get("hang")),
        "violations_by_mutator": dict(by_mut.most_common()),
        "violation_examples": [e for p in ok for e in p.get("violation_examples", [])][:20],
        "processes_died": [{k: v for k, v in p.items() if k != "died"} for p in died],
        "slowest_input_s": slowest.get("slowest_input_s") if slowest else None,
        "slowest_input": slowest.get("slowest_input") if slowest else None,
        "peak_rss_growth_bytes": max((p.get("peak_rss_growth_bytes", 0) for p in ok), default=0),
        "skipped": sorted({x for p in ok for x in p.get("skipped", [])}),
        "versions": ok[0].get("versions", {}) if ok else {},
    }


def _other(summary: dict[str, Any], name: str) -> dict[str, Any]:
    if summary.get("died"):
        return {
            "campaign": name,
            "inputs": 0,
            "outcomes": {},
            "violations": {"died": 1},
            "violation_count": 1,
            "untyped_exceptions": 0,
            "hangs": int(bool(summary.get("hang"))),
            "slowest_input_s": None,
            "skipped": [],
            "died": summary,
        }
    return summary


def run_campaigns(
    runs: dict[str, int],
    procs: int,
    seed: int,
    cli_hang_s: float,
    store_real_server: bool = True,
    calibration_procs: int = 1,
    calibration_seconds: float | None = None,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtc-campaign-") as d:
        tmp = Path(d)
        jobs: dict[str, list[tuple[subprocess.Popen, Path, list[str], Path]]] = {}

        def start(name: str, script: str, args: list[str], i: int = 0) -> None:
            log = tmp / f"{name}{i}.log"
            proc, out, cmd = _launch(script, args, tmp / f"{name}{i}.json", log)
            jobs.setdefault(name, []).append((proc, out, cmd, log))

        if runs["container"]:
            per = [runs["container"] // procs + (i < runs["container"] % procs) for i in range(procs)]
            for i, n in enumerate(per):
                if n:
                    start(
                        "container",
                        "fuzz_container.py",
                        ["--runs", str(n), "--seed", str(seed * 1000 + i), "--profile", "long", "--fast", "--quiet"],
                        i,
                    )
        if runs["calibration"]:
            n, k = runs["calibration"], max(1, calibration_procs)
            for i in range(k):
                part = n // k + (i < n % k)
                if part:
                    extra = ["--seconds", str(calibration_seconds)] if calibration_seconds else []
                    seed_i = str(seed * 1000 + i if k > 1 else seed)
                    start("calibration", "fuzz_calibration.py", ["--runs", str(part), "--seed", seed_i, *extra], i)
        if runs["store"]:
            start(
                "store",
                "fuzz_store.py",
                ["--runs", str(runs["store"]), "--seed", str(seed)]
                + ([] if store_real_server else ["--no-real-server"]),
            )
        if runs["cli"]:
            start("cli", "fuzz_cli.py", ["--runs", str(runs["cli"]), "--seed", str(seed), "--hang-s", str(cli_hang_s)])
        for procs_ in jobs.values():
            for proc, *_ in procs_:
                proc.wait()
        results: dict[str, Any] = {}
        commands: dict[str, list[str]] = {}
        for name, items in jobs.items():
            parts = [_read(out, proc, log) for proc, out, _, log in items]
            commands[name] = [" ".join(shlex.quote(c) for c in cmd[1:-2]) for _, _, cmd, _ in items][:2]
            results[name] = combine_container(parts) if name == "container" else combine_tallies(parts, name)
    return {"campaigns": results, "commands": commands, "seconds": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------------------------------ the table
def _n(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def _outcomes(c: dict[str, Any], top: int = 4) -> str:
    items = list(c.get("outcomes", {}).items())
    text = ", ".join(f"{k} {_n(v)}" for k, v in items[:top])
    if len(items) > top:
        text += f", {len(items) - top} more"
    if c.get("campaign") == "container":
        text += (
            f" (over the 5 entry points; {_n(c.get('header_valid_inputs', 0))} headers valid, "
            f"{_n(c.get('decoded_inputs', 0))} decoded)"
        )
    return text or "-"


def _others(c: dict[str, Any]) -> str:
    v = {k: n for k, n in c.get("violations", {}).items() if k not in ("exception", "hang")}
    if c.get("processes_died"):
        v["process died"] = len(c["processes_died"]) - c.get("hangs", 0)
    v = {k: n for k, n in v.items() if n}
    return ", ".join(f"{k} {_n(n)}" for k, n in v.items()) or "0"


def render(result: dict[str, Any]) -> str:
    rows = [
        "| Campaign | Inputs | Outcomes | Untyped exceptions | Hangs | Other violations | Slowest input |",
        "|---|---:|---|---:|---:|---|---:|",
    ]
    names = {
        "container": "container (structure-aware, CRCs re-sealed)",
        "calibration": "calibration files",
        "store": "stores (URLs, RESP, redis-server, files)",
        "cli": "CLI (`kvtc.cli.main`)",
    }
    notes = []
    for name in ("container", "calibration", "store", "cli"):
        c = result["campaigns"].get(name)
        if c is None:
            continue
        slow = c.get("slowest_input_s")
        rows.append(
            f"| {names[name]} | {_n(c.get('inputs', 0))} | {_outcomes(c)} | {_n(c.get('untyped_exceptions', 0))} "
            f"| {_n(c.get('hangs', 0))} | {_others(c)} | {f'{slow:.3f} s' if slow is not None else '-'} |"
        )
        for s in c.get("skipped", []):
            notes.append(f"{name}: skipped {s}")
        by = list(c.get("violations_by_mutator", {}).items())
        if by:
            notes.append(
                f"{name} violations by input kind: "
                + ", ".join(f"{k} {_n(n)}" for k, n in by[:10])
                + (f" and {len(by) - 10} more kinds" if len(by) > 10 else "")
            )
        if name == "store" and c.get("redis_server"):
            notes.append(f"store: real-server part against redis-server {c['redis_server']}")
    v = result.get("versions", {})
    lines = [START, "### Hostile-input campaigns", "", *rows, ""]
    if notes:
        lines += [textwrap.fill("Notes: " + "; ".join(notes) + ".", 120), ""]
    if result.get("parts"):  # merged: several runs, one after another (their commands below)
        how = f"{len(result['parts'])} runs, one command each, {result['seconds']:,.0f} s of wall time in all"
    else:
        how = (
            f"wall time {result['seconds']:,.0f} s (container in "
            f"{result['campaigns'].get('container', {}).get('processes', 0)} processes, calibration in "
            f"{result['campaigns'].get('calibration', {}).get('processes', 1)}, the others one process each, all at once)"
        )
    text = [
        f"Date {result['date']}; machine: {result['machine']}; {how}.",
        "Versions: " + ", ".join(f"{k} {v[k]}" for k in sorted(v)) + ".",
        f"Command: `{result['command']}`. Limits: container and calibration 1 s per entry point (the container's "
        "allocation bounded by its header), store 10 s per operation, CLI "
        f"{result['cli_hang_s']:g} s per invocation (exit 2, one stderr line, no traceback, no model loaded, "
        "nothing written outside its temp dir). Summary: `benchmarks/results/fuzz_campaigns.json`.",
    ]
    lines += [textwrap.fill(t, 120, break_on_hyphens=False, break_long_words=False) if t else t for t in text] + [END]
    return "\n".join(lines)


def write_benchmarks(path: Path, table: str) -> None:
    text = path.read_text() if path.exists() else ""
    if START in text and END in text:
        a, b = text.index(START), text.index(END) + len(END)
    elif OLD_START in text and OLD_END in text:
        a, b = text.index(OLD_START), text.index(OLD_END) + len(OLD_END)
    else:
        a = b = len(text)
        table = "\n" + table + "\n"
    path.write_text(text[:a] + table + text[b:])


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result of campaigns run in several invocations (a campaign split over machines or time budgets: its
    parts summed as :func:`combine_tallies` does)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        for name, c in r["campaigns"].items():
            by.setdefault(name, []).append(c)
    campaigns = {}
    for name, parts in by.items():
        if len(parts) == 1:
            campaigns[name] = parts[0]
            continue
        m = combine_tallies(parts, name)
        m["processes"] = sum(p.get("processes", 1) for p in parts)
        m["outcomes"] = dict(sum((Counter(p.get("outcomes", {})) for p in parts), Counter()).most_common())
        campaigns[name] = m

    def joined(key: str) -> str:
        return " + ".join(dict.fromkeys(str(r[key]) for r in results))

    return {
        "campaigns": campaigns,
        "seconds": sum(r["seconds"] for r in results),
        "date": joined("date"),
        "machine": joined("machine"),
        "command": joined("command"),
        "cli_hang_s": max(r.get("cli_hang_s", 0) for r in results),
        "versions": results[0].get("versions", {}),
        "parts": [{k: r[k] for k in ("date", "machine", "command", "seconds")} for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--merge", nargs="+", type=Path, help="merge these result files into one table instead of running")
    ap.add_argument(
        "--procs",
        type=int,
        default=max(1, (os.cpu_count() or 4) - 3),
        help="container processes (the other three campaigns take one each)",
    )
    ap.add_argument("--runs-per-campaign", type=int, default=None, help="inputs for every campaign")
    for name, n in DEFAULT_RUNS.items():
        ap.add_argument(f"--{name}-runs", type=int, default=None, help=f"inputs (default {n:,})")
    ap.add_argument("--calibration-procs", type=int, default=1, help="processes of the calibration campaign")
    ap.add_argument("--calibration-seconds", type=float, default=None, help="time budget of each calibration process")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--cli-hang-s", type=float, default=20.0, help="seconds a CLI invocation may run")
    ap.add_argument("--no-real-server", action="store_true", help="skip the store campaign's real redis-server part")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--benchmarks", type=Path, default=BENCHMARKS)
    ap.add_argument("--no-benchmarks", action="store_true", help="do not touch BENCHMARKS.md")
    args = ap.parse_args(argv)
    runs = {}
    for name, n in DEFAULT_RUNS.items():
        own = getattr(args, f"{name}_runs")
        runs[name] = own if own is not None else args.runs_per_campaign if args.runs_per_campaign is not None else n
    sys.path.insert(0, str(HERE))
    from common import scrub, versions

    if args.merge:
        result = merge([json.loads(p.read_text()) for p in args.merge])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(scrub(json.dumps(result, indent=1, default=str)) + "\n")
        table = render(result)
        if not args.no_benchmarks:
            write_benchmarks(args.benchmarks, table)
        print(table)
        return 1 if any(c.get("violation_count") for c in result["campaigns"].values()) else 0
    result = run_campaigns(
        runs,
        args.procs,
        args.seed,
        args.cli_hang_s,
        not args.no_real_server,
        args.calibration_procs,
        args.calibration_seconds,
    )
    shown = ["python", "fuzz/campaign.py", *(argv if argv is not None else sys.argv[1:])]
    result.update(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine(),
        command=" ".join(shlex.quote(a) for a in shown),
        cli_hang_s=args.cli_hang_s,
        runs=runs,
        versions=versions(),
    )
    for name, c in result["campaigns"].items():
        print(
            f"{name}: {c.get('inputs', 0):,} inputs, violations {c.get('violations')}, "
            f"untyped {c.get('untyped_exceptions')}, hangs {c.get('hangs')}",
            file=sys.stderr,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(scrub(json.dumps(result, indent=1, default=str)) + "\n")
    table = render(result)
    if not args.no_benchmarks:
        write_benchmarks(args.benchmarks, table)
    print(table)
    bad = any(c.get("violation_count") for c in result["campaigns"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
