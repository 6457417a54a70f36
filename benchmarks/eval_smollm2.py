"""The embedded default's quality-vs-bytes benchmark: ``kvtc eval`` with its defaults on SmolLM2-135M.

Writes benchmarks/results/eval_smollm2.{json,md,png} and the ``eval_smollm2`` section of BENCHMARKS.md.
Extra arguments go to ``kvtc eval`` (e.g. ``--device cuda``); ``--render`` re-renders the saved result.
"""

from __future__ import annotations

import argparse
import json
import sys

import _report
from kvtc.eval import report
from kvtc.eval.cli import config_from_args, register
from kvtc.eval.suite import acceptance, run


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
    head = (
        f"### {title} (`kvtc eval`)\n\n`{result['command']}` — "
        f"{date}.\n\n![quality vs bytes](benchmarks/results/{stem}.png)\n\n"
    )
    _report.update_section(stem, head + md)
    print(md)
    for kind, path in paths.items():
        print(f"{kind}: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(bench("eval_smollm2", "Quality vs bytes on SmolLM2-135M", sys.argv[1:]))
