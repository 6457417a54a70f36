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


def update_section(name: str, markdown: str) -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->`` in BENCHMARKS.md
    (appending the section when it is not there yet)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)


def publish(name: str, result: dict[str, Any], markdown: str) -> None:
    """Write ``results/{name}.json``, replace the ``name`` section of BENCHMARKS.md and print the section."""
    write_json(name, result)
    update_section(name, markdown)
    print(markdown)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(out)


#: the storage round trip's per-method figures the benchmarks report
ROUNDTRIP_KEYS = ("ratio", "delta_ppl_pct", "kl", "top1_agreement", "k_rel_error", "v_rel_error")


def roundtrip_cells(r: dict[str, Any]) -> str:
    """A round trip's :data:`ROUNDTRIP_KEYS` figures as the cells that end a markdown table row."""
    return (
        f"{r['ratio']:.2f}× | {r['delta_ppl_pct']:+.2f}% | {r['kl']:.4f} | {r['top1_agreement']:.3f} | "
        f"{r['k_rel_error']:.3f} | {r['v_rel_error']:.3f} |"
    )


def roundtrip_rows(
    model: Any, tok: Any, methods: list[Any], texts: list[str], windows: int
) -> list[tuple[str, Any, dict[str, Any]]]:
    """``kvtc eval``'s storage round trip of ``methods`` on ``windows`` windows (seed 0) of each built-in text:
    ``(text, method, {figure: value})`` for every pair."""
    from kvtc import assets
    from kvtc.eval.protocols import storage_roundtrip
    from kvtc.eval.suite import DEFAULT_CONTEXT, DEFAULT_CONTINUATION

    out = []
    for text in texts:
        ids = assets.token_windows(
            tok, assets.corpus(text), DEFAULT_CONTEXT + DEFAULT_CONTINUATION + 1, windows, seed=0
        )
        tallies = storage_roundtrip(model, ids, methods, DEFAULT_CONTEXT)
        for m in methods:
            s = tallies[m.label].summary()
            out.append((text, m, {k: s.get(k) for k in ROUNDTRIP_KEYS}))
    return out


def cuda_timed(fn: Any, reps: int = 10) -> float:
    """Median seconds of ``fn()`` on the current CUDA device over ``reps`` runs (CUDA events), after one warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def heldout_roundtrips(model: Any, tok: Any, methods: list[Any], texts: list[str], windows: int, seed: int) -> Any:
    """Yield ``(text, method, summary)`` of the storage round trip of ``windows`` windows (2,048 + 256 tokens, drawn
    with ``seed``) of each of ``texts`` through ``methods``: the held-out protocol of the tuning studies."""
    from kvtc import assets
    from kvtc.eval.protocols import storage_roundtrip
    from kvtc.eval.suite import DEFAULT_CONTEXT, DEFAULT_CONTINUATION

    for text in texts:
        ids = assets.token_windows(
            tok, assets.corpus(text), DEFAULT_CONTEXT + DEFAULT_CONTINUATION + 1, windows, seed=seed
        )
        tallies = storage_roundtrip(model, ids, methods, DEFAULT_CONTEXT)
        for m in methods:
            yield text, m, tallies[m.label].summary()
