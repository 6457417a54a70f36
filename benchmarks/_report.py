"""Shared helpers of the benchmark scripts: machine facts, JSON results, and BENCHMARKS.md sections."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# benchmarks run from a checkout share its asset cache with `make test` / `make demo`
os.environ.setdefault("KVTC_CACHE", str(ROOT / ".cache"))
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
#: full forms of the sections too long for BENCHMARKS.md (which keeps a summary and a link)
DETAILS = ROOT / "docs" / "results"


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import kvtc

        info["kvtc"] = kvtc.__version__
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except Exception:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def write_details(name: str, markdown: str) -> str:
    """Write the full form of section ``name`` to ``docs/results/{name}.md`` (its ``###`` heading made the page's
    title, its links to files of the checkout made relative to that page) and return the line that links it."""
    body = markdown.strip()
    if body.startswith("### "):
        body = "# " + body[4:]
    body = body.replace("](benchmarks/", "](../../benchmarks/")
    DETAILS.mkdir(parents=True, exist_ok=True)
    (DETAILS / f"{name}.md").write_text(body + "\n")
    return f"Full report: [docs/results/{name}.md](docs/results/{name}.md)."


def update_section(name: str, markdown: str, details: str | None = None) -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->`` in BENCHMARKS.md
    (appending the section when it is not there yet). With ``details``, the section's full form goes to
    ``docs/results/{name}.md`` (:func:`write_details`) and BENCHMARKS.md keeps ``markdown``, its summary, and a link:
    BENCHMARKS.md holds the current figures only and stays short."""
    if details is not None:
        markdown = markdown.rstrip() + "\n\n" + write_details(name, details)
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)


def publish(name: str, result: dict[str, Any], markdown: str, details: str | None = None) -> None:
    """Write ``results/{name}.json``, replace the ``name`` section of BENCHMARKS.md (``details``: its full form, in
    ``docs/results/{name}.md``, see :func:`update_section`) and print the section's full form."""
    write_json(name, result)
    update_section(name, markdown, details)
    print(details or markdown)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(out)
