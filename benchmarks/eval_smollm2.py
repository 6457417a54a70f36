"""The embedded default's quality-vs-bytes benchmark: ``kvtc eval`` with its defaults on SmolLM2-135M.

Writes benchmarks/results/eval_smollm2.{json,md,png} and the ``eval_smollm2`` section of BENCHMARKS.md.
Extra arguments go to ``kvtc eval`` (e.g. ``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import sys

import _report
from kvtc.eval import report
from kvtc.eval.cli import config_from_args, register
from kvtc.eval.suite import acceptance, run


def main(argv: list[str]) -> int:
    if argv[:1] == ["--render"]:
        # re-render the table, plot and BENCHMARKS.md section of a saved result (acceptance recomputed)
        result = json.loads((_report.RESULTS / "eval_smollm2.json").read_text())
        result["acceptance"] = acceptance(result)
    else:
        parser = argparse.ArgumentParser(prog="eval_smollm2")
        sub = parser.add_subparsers()
        register(sub)
        args = parser.parse_args(["eval", *argv])
        result = run(config_from_args(args))
        result["command"] = _report.command()
    paths = report.write(result, _report.RESULTS, stem="eval_smollm2")
    md = report.markdown(result)
    head = (
        f"### Quality vs bytes on SmolLM2-135M (`kvtc eval`)\n\n`{result['command']}` — "
        f"{_report.machine()['date']}.\n\n![quality vs bytes](benchmarks/results/eval_smollm2.png)\n\n"
    )
    _report.update_section("eval_smollm2", head + md)
    print(md)
    for kind, path in paths.items():
        print(f"{kind}: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
