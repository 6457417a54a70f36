"""The embedded default's quality-vs-bytes benchmark: ``kvtc eval`` with its defaults on SmolLM2-135M.

Writes benchmarks/results/eval_smollm2.{json,md,png}, the ``eval_smollm2`` section of BENCHMARKS.md (a summary: kvtc
at the eval's default targets and the main baselines) and its full report, docs/results/eval_smollm2.md. Extra
arguments go to ``kvtc eval`` (e.g. ``--device cuda``); ``--render`` re-renders the saved result.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import _report
from kvtc.eval import report
from kvtc.eval.cli import config_from_args, register
from kvtc.eval.suite import acceptance, run
from kvtc.textsafe import printable

#: the rows of the BENCHMARKS.md summary (the full report has every method and ratio)
SUMMARY_ROWS = (
    "exact",
    *(f"kvtc {t}x" for t in (8, 16, 32, 64)),
    "fp8-e4m3",
    "KIVI 4-bit",
    "KIVI 2-bit",
    "StreamingLLM 16x",
)


def head(result: dict[str, Any], title: str, date: str) -> str:
    """The section's heading and its run: command, date, machine, run time, calibration."""
    m, t, cal = result.get("machine", {}), result.get("timings_s", {}), result["calibration"]
    gpu = f", {printable(m['gpu'])}" if m.get("gpu") else ""
    return (
        f"### {title} (`kvtc eval`)\n\n`{result['command']}` — {date}; {printable(m.get('cpu', '?'))} "
        f"({m.get('cores', '?')} cores, {m.get('torch_threads', '?')} torch threads{gpu}), "
        f"{t.get('total', 0) / 60:.1f} min; calibration `{printable(cal['name'])}`."
    )


def summary(result: dict[str, Any]) -> str:
    """The storage round trip's :data:`SUMMARY_ROWS` (those the run has) as a markdown table."""
    cfg = result["config"]
    by = {r["method"]: r for r in result["storage_roundtrip"]}
    ret = {r["method"]: r for r in result.get("retrieval", [])}
    lines = [
        f"{cfg['windows']} windows of {cfg['context']:,} context + {cfg['continuation']} scored tokens of "
        f"{', '.join(printable(t) for t in result['texts'])} text; {cfg['sinks']} sinks and the {cfg['window']} newest "
        "tokens exact.",
        "",
        "| method | ratio | Δppl | KL mean | KL p90 | KL max | copy KL | top-1 agree | pass-key acc. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    f = report._f
    for name in SUMMARY_ROWS:
        r = by.get(name)
        if r is None:
            continue
        acc = f"{ret[name]['accuracy']:.2f}" if name in ret else ""
        if r["curve"] == "exact":
            lines.append(f"| exact | 1 | ppl {r['ppl']:.3f} | 0 | 0 | 0 | 0 | 1 | {acc} |")
            continue
        lines.append(
            f"| {name} | {r['ratio']:.2f}× | {report._pct(r.get('delta_ppl_pct'))} | {f(r.get('kl'))} | "
            f"{f(r.get('kl_p90'))} | {f(r.get('kl_max'))} | {f(r.get('copy_kl'))} | {f(r.get('top1_agreement'))} "
            f"| {acc} |"
        )
    exact = by.get("exact", {})
    if "copy_tokens" in exact:
        lines += [
            "",
            f"KL p90 / max: over the windows' means; copy KL: over the {exact['copy_tokens']} copy tokens of "
            f"{exact['copy_windows']} windows (continuation tokens whose bigram occurs in the compressed span and not "
            "among the exact tokens before them).",
        ]
    if result.get("needles"):
        lines += report._needle_lines(result["needles"])
        if result.get("needles_command"):  # the needles measured by a run of their own
            lines += ["", f"Needles: `{result['needles_command']}`."]
    checks = {k: v for k, v in result.get("acceptance", {}).items() if "window" in k or "copy" in k or "needles" in k}
    if checks:
        lines += [
            "",
            "Worst-case bars: " + "; ".join(f"{k} {'pass' if v['pass'] else 'FAIL'}" for k, v in checks.items()),
        ]
    return "\n".join(lines)


def bench(stem: str, title: str, argv: list[str], defaults: list[str] | None = None) -> int:
    """Run ``kvtc eval`` (``defaults`` then ``argv``) or re-render (``--render``) and write result ``stem``."""
    if argv[:1] == ["--render"]:
        # re-render the table, plot and BENCHMARKS.md section of a saved result (acceptance recomputed)
        result = json.loads((_report.RESULTS / f"{stem}.json").read_text())
        result["acceptance"] = acceptance(result)
    else:
        parser = argparse.ArgumentParser(prog=stem)
        sub = parser.add_subparsers()
        register(sub)
        args = parser.parse_args(["eval", *(defaults or []), *argv])
        result = run(config_from_args(args))
        result["command"] = _report.command()
    paths = report.write(result, _report.RESULTS, stem=stem)
    md = report.markdown(result)
    date = result.get("machine", {}).get("date") or _report.machine()["date"]  # when the run was made
    top = head(result, title, date)
    plot = f"![quality vs bytes](benchmarks/results/{stem}.png)"
    _report.update_section(stem, f"{top}\n{summary(result)}", details=f"{top}\n\n{plot}\n\n{md}")
    print(md)
    for kind, path in paths.items():
        print(f"{kind}: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(bench("eval_smollm2", "Quality vs bytes on SmolLM2-135M", sys.argv[1:]))
