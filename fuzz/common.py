"""Shared pieces of the hostile-input campaigns (calibration, store, CLI): the per-campaign tally and its JSON
summary, peak-RSS measurement, running one call under a time limit, and a helper to write the summary.

Every campaign reports the same fields: ``inputs``, ``outcomes`` (what each input ended as, by type),
``violations`` (by kind: ``exception`` for an untyped exception, ``hang``, ``slow``, ``memory`` and campaign
specific kinds), ``violation_examples`` (a few, with a reproducer), ``slowest_input_s``, ``peak_rss_growth_bytes``
and ``skipped`` (parts that could not run here, and why).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import resource
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HWM = re.compile(rb"VmHWM:\s+(\d+) kB")
_CLEAR_REFS_OK: list[bool] = []


def reset_hwm() -> int | None:
    """Reset the process's peak RSS (Linux ``/proc/self/clear_refs``); returns the current RSS, or None."""
    if _CLEAR_REFS_OK == [False]:
        return None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _CLEAR_REFS_OK[:] = [True]
    except OSError:
        _CLEAR_REFS_OK[:] = [False]
        return None
    return hwm()


def hwm() -> int:
    with open("/proc/self/status", "rb") as f:
        m = _HWM.search(f.read())
    return int(m.group(1)) * 1024 if m else 0


class Hung(Exception):
    """A call still running after its time limit (the thread is left behind, as a real hang would be)."""


def call_with_timeout(fn: Callable[[], Any], timeout: float, on_timeout: Callable[[], None] | None = None) -> Any:
    """``fn()`` in a worker thread: its result, its exception re-raised, or :class:`Hung` after ``timeout`` s.

    ``on_timeout`` runs once the limit has passed (e.g. to unblock a FIFO the call waits on), and the call
    gets one more second to return before it counts as hung."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append((False, e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        if on_timeout is not None:
            on_timeout()
            t.join(1.0)
        if not box:
            raise Hung(f"still running after {timeout:g} s")
    ok, value = box[0]
    if ok:
        return value
    raise value


@dataclass
class Tally:
    """What one campaign saw."""

    campaign: str
    seed: int
    inputs: int = 0
    outcomes: Counter = field(default_factory=Counter)
    mutators: Counter = field(default_factory=Counter)
    violations: Counter = field(default_factory=Counter)
    examples: list[dict] = field(default_factory=list)
    slowest_s: float = 0.0
    slowest_what: str = ""
    peak_rss_growth: int = 0
    violations_by_mutator: Counter = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)
    parts: Counter = field(default_factory=Counter)
    extra: dict[str, Any] = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)

    def add(
        self,
        part: str,
        mutator: str,
        outcome: str,
        seconds: float,
        what: str,
        violation: tuple[str, str] | None = None,
        rss_growth: int | None = None,
    ) -> None:
        self.inputs += 1
        self.parts[part] += 1
        self.mutators[f"{part}:{mutator}"] += 1
        self.outcomes[outcome] += 1
        if seconds > self.slowest_s:
            self.slowest_s, self.slowest_what = seconds, f"{part}:{mutator}: {what[:200]}"
        if rss_growth is not None:
            self.peak_rss_growth = max(self.peak_rss_growth, rss_growth)
        if violation is not None:
            kind, detail = violation
            self.violations[kind] += 1
            self.violations_by_mutator[f"{kind} in {part}:{mutator}"] += 1
            if sum(1 for e in self.examples if e["kind"] == kind) < 10 and len(self.examples) < 40:
                self.examples.append(
                    {"kind": kind, "part": part, "mutator": mutator, "input": what[:2000], "detail": detail[-3000:]}
                )

    def summary(self, target: str, time_limit_s: float, hang_s: float) -> dict[str, Any]:
        secs = time.perf_counter() - self.t0
        untyped = self.violations.get("exception", 0)
        return {
            "campaign": self.campaign,
            "target": target,
            "seed": self.seed,
            "inputs": self.inputs,
            "inputs_by_part": dict(self.parts.most_common()),
            "seconds": round(secs, 1),
            "inputs_per_s": round(self.inputs / secs, 1) if secs else None,
            "outcomes": dict(self.outcomes.most_common()),
            "violations": dict(self.violations.most_common()),
            "violation_count": sum(self.violations.values()),
            "untyped_exceptions": untyped,
            "hangs": self.violations.get("hang", 0),
            "violations_by_mutator": dict(self.violations_by_mutator.most_common()),
            "violation_examples": self.examples,
            "slowest_input_s": round(self.slowest_s, 4),
            "slowest_input": self.slowest_what,
            "time_limit_s": time_limit_s,
            "hang_limit_s": hang_s,
            "peak_rss_growth_bytes": self.peak_rss_growth,
            "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "mutators": dict(self.mutators.most_common()),
            "skipped": self.skipped,
            **self.extra,
            "versions": versions(),
        }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("kvtc", "torch", "numpy", "safetensors", "redis"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = __import__(name)
            except ImportError:
                continue
        out[name] = str(getattr(mod, "__version__", "?"))
    return out


_ROOT = Path(__file__).resolve().parent.parent


def scrub(text: str) -> str:
    """``text`` without this machine's paths: the checkout, temp dirs and the Python installation."""
    import tempfile

    text = text.replace(str(_ROOT) + "/", "")
    text = re.sub(re.escape(tempfile.gettempdir()) + r"/kvtc-[\w.-]+", "<tmp>", text)
    return re.sub(r'"/[^"\n]*?/lib/python3\.\d+/', '"<python>/', text)


def write_summary(summary: dict[str, Any], out: Path | None) -> str:
    text = scrub(json.dumps(summary, indent=1, default=str))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return text


def outcome_of(e: BaseException) -> str:
    return type(e).__name__


def campaign_args(
    doc: str, runs: int, argv: list[str] | None, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The options every campaign script takes (``--runs``, ``--seed``, ``--out``) plus ``extra``'s."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=runs, help=f"inputs (default {runs:,})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    if extra is not None:
        extra(ap)
    return ap.parse_args(argv)
