"""The break-even arithmetic of ``kvtc bench``: pure functions of measured bytes and seconds (no torch).

Three ways to give a request the KV cache of an ``N``-token context it has seen before:

* **recompute**: prefill the context again; TTFT = ``t_prefill``.
* **raw transfer**: fetch the 16-bit KV over a link of ``B`` bytes/s; TTFT = ``raw_bytes / B``.
* **compressed transfer**: fetch the kvtc blob and decode it into the model's cache;
  TTFT = ``stored_bytes / B + t_decode``.

The first new token's forward step (one token against the restored or recomputed cache) is the same in all three
and is left out of every TTFT (``kvtc bench`` reports it beside them as ``first_step_s``).

Break-even bandwidths, in bytes/s:

* compressed beats recompute when ``stored / B + t_decode < t_prefill``, i.e. on links **faster** than
  ``B* = stored / (t_prefill - t_decode)``; when ``t_decode >= t_prefill`` it never does (None);
* compressed beats raw when ``stored / B + t_decode < raw / B``, i.e. on links **slower** than
  ``B** = (raw - stored) / t_decode``; when ``stored >= raw`` it never does (None);
* raw beats recompute on links faster than ``raw / t_prefill``.

So compression is the fastest of the three for ``B*`` < ``B`` < ``B**`` (an empty window when ``B* >= B**``). The
cache capacity multiplier (how many more contexts the same memory keeps) is ``raw / stored``.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

__all__ = [
    "BreakEven",
    "Ttft",
    "break_even_bandwidth",
    "capacity_multiplier",
    "compressed_vs_raw",
    "compressed_vs_recompute",
    "fastest",
    "format_bandwidth",
    "format_bytes",
    "format_seconds",
    "format_tokens",
    "parse_bandwidth",
    "parse_bandwidths",
    "parse_ratios",
    "parse_tokens",
    "parse_token_list",
    "raw_vs_recompute",
    "ttft",
    "winning_window",
]

PATHS = ("recompute", "raw", "compressed")


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number above 0, got {value!r}")
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def compressed_vs_recompute(stored_bytes: float, t_prefill: float, t_decode: float) -> float | None:
    """``B* = stored / (t_prefill - t_decode)``: compressed transfer + decode beats recomputing on links faster than
    this; None when ``t_decode >= t_prefill`` (decoding alone takes as long as the prefill: compression never wins)."""
    stored = _positive("stored_bytes", stored_bytes)
    margin = _non_negative("t_prefill", t_prefill) - _non_negative("t_decode", t_decode)
    return stored / margin if margin > 0 else None


def compressed_vs_raw(raw_bytes: float, stored_bytes: float, t_decode: float) -> float | None:
    """``B** = (raw - stored) / t_decode``: compressed transfer + decode beats raw 16-bit transfer on links slower
    than this; None when ``stored >= raw`` (nothing saved); ``inf`` for a decode of zero seconds."""
    saved = _positive("raw_bytes", raw_bytes) - _positive("stored_bytes", stored_bytes)
    t_dec = _non_negative("t_decode", t_decode)
    if saved <= 0:
        return None
    return saved / t_dec if t_dec > 0 else math.inf


def raw_vs_recompute(raw_bytes: float, t_prefill: float) -> float | None:
    """``raw / t_prefill``: raw transfer beats recomputing on links faster than this (None for a zero prefill)."""
    t = _non_negative("t_prefill", t_prefill)
    return _positive("raw_bytes", raw_bytes) / t if t > 0 else None


class BreakEven(NamedTuple):
    """The three break-even bandwidths (bytes/s; None: never)."""

    vs_recompute: float | None  # compressed beats recompute above this
    vs_raw: float | None  # compressed beats raw below this
    raw_vs_recompute: float | None  # raw beats recompute above this


def break_even_bandwidth(raw_bytes: float, stored_bytes: float, t_prefill: float, t_decode: float) -> BreakEven:
    """All three break-even bandwidths of one (context, ratio) measurement (see the module docstring)."""
    return BreakEven(
        compressed_vs_recompute(stored_bytes, t_prefill, t_decode),
        compressed_vs_raw(raw_bytes, stored_bytes, t_decode),
        raw_vs_recompute(raw_bytes, t_prefill),
    )


def winning_window(be: BreakEven) -> tuple[float, float] | None:
    """``(low, high)``: the link bandwidths between which compressed transfer is the fastest path; None if none."""
    if be.vs_recompute is None or be.vs_raw is None or be.vs_recompute >= be.vs_raw:
        return None
    return be.vs_recompute, be.vs_raw


class Ttft(NamedTuple):
    """Seconds to the first token by each path at one link bandwidth (the shared first step left out)."""

    recompute: float
    raw: float
    compressed: float


def ttft(raw_bytes: float, stored_bytes: float, t_prefill: float, t_decode: float, link: float) -> Ttft:
    """TTFT of recompute (``t_prefill``), raw transfer (``raw / link``) and compressed transfer
    (``stored / link + t_decode``) over a link of ``link`` bytes/s."""
    b = _positive("link", link)
    return Ttft(
        _non_negative("t_prefill", t_prefill),
        _positive("raw_bytes", raw_bytes) / b,
        _positive("stored_bytes", stored_bytes) / b + _non_negative("t_decode", t_decode),
    )


def fastest(t: Ttft) -> str:
    """The path with the smallest TTFT (``recompute``, ``raw`` or ``compressed``; ties go to the earlier)."""
    return min(PATHS, key=lambda p: getattr(t, p))


def capacity_multiplier(raw_bytes: float, stored_bytes: float) -> float:
    """How many times more contexts the same cache memory holds compressed: ``raw / stored``."""
    return _positive("raw_bytes", raw_bytes) / _positive("stored_bytes", stored_bytes)


# ---------------------------------------------------------------------- parsing and formatting

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]i?)?(b|bit|bits)?\s*(?:/s|ps)?\s*$", re.I)
BANDWIDTH_EXAMPLES = "e.g. 10GB/s, 1GB/s, 100MB/s, 25Gbit/s, 1.5GiB/s"


def parse_bandwidth(text: str) -> float:
    """Bytes per second of a link given as ``10GB/s``, ``100MB/s``, ``1.5GiB/s`` (bytes; K/M/G/T are powers of
    1000, Ki/Mi/Gi/Ti of 1024) or ``25Gbit/s`` / ``25Gbps`` (bits, a lower-case ``b``). Raises ValueError."""
    m = _BANDWIDTH.match(text)
    if not m or (m.group(3) is None and m.group(2) is None):
        raise ValueError(f"{text.strip()[:40]!r} is not a link bandwidth ({BANDWIDTH_EXAMPLES})")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    unit = m.group(3) or "B"
    if unit.lower().startswith("bit") or unit == "b":
        value /= 8
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{text.strip()[:40]!r} must be a bandwidth above 0 ({BANDWIDTH_EXAMPLES})")
    return value


def _items(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not items or any(not x for x in items):
        raise ValueError(f"{text.strip()[:40]!r} is not a comma-separated list of {what}")
    return items


def parse_bandwidths(text: str) -> tuple[float, ...]:
    """A comma-separated list of :func:`parse_bandwidth` values, in the order given."""
    return tuple(parse_bandwidth(x) for x in _items(text, "link bandwidths"))


_TOKENS = re.compile(r"^([0-9]+)\s*([km]?)$", re.I)
#: the most tokens a context may have
MAX_CONTEXT = 1 << 21


def parse_tokens(text: str) -> int:
    """A context length: ``4096``, ``4k`` (= 4,096: K is 1,024 tokens, as in "8K context") or ``1m``."""
    m = _TOKENS.match(text.strip())
    if not m:
        raise ValueError(f"{text.strip()[:40]!r} is not a context length (e.g. 1k, 8k, 32k or 4096)")
    n = int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2).lower()]
    if not 1 <= n <= MAX_CONTEXT:
        raise ValueError(f"context length {text.strip()[:40]} must be from 1 to {MAX_CONTEXT} tokens")
    return n


def parse_token_list(text: str) -> tuple[int, ...]:
    """Sorted, distinct :func:`parse_tokens` values of a comma-separated list."""
    return tuple(sorted({parse_tokens(x) for x in _items(text, "context lengths")}))


def parse_ratios(text: str) -> tuple[float, ...]:
    """Sorted, distinct compression ratios (numbers above 1, an optional trailing ``x``) of a comma-separated list."""
    out = set()
    for item in _items(text, "ratios"):
        body = item[:-1] if item.lower().endswith("x") else item
        try:
            r = float(body)
        except ValueError:
            raise ValueError(f"{item[:40]!r} is not a compression ratio (e.g. 8,16,32)") from None
        if not (math.isfinite(r) and r > 1):
            raise ValueError(f"{item[:40]!r} is not a compression ratio: give numbers above 1 (e.g. 8,16,32)")
        out.add(r)
    return tuple(sorted(out))


def _num(x: float) -> str:
    """Three significant digits without exponent for 0 <= x < 1000 (``1.23``, ``12.3``, ``123``)."""
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _scaled(x: float, units: tuple[tuple[str, float], ...], last: str) -> str:
    for unit, scale in units:
        if x >= scale:
            return f"{_num(x / scale)} {unit}"
    return f"{_num(x)} {last}"


def format_bandwidth(bps: float | None) -> str:
    """``1.20 GB/s`` (powers of 1000); ``never`` for None, ``any`` for infinity."""
    if bps is None:
        return "never"
    if math.isinf(bps):
        return "any"
    return _scaled(bps, (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)), "B/s")


def format_bytes(n: float) -> str:
    """``94.4 MB`` (powers of 1000)."""
    return _scaled(n, (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)), "B")


def format_seconds(s: float) -> str:
    """``0.85 ms``, ``850 ms`` below a second, ``12.3 s`` from one on."""
    return f"{_num(s)} s" if s >= 1 else f"{_num(s * 1e3)} ms"


def format_tokens(n: int) -> str:
    """``4K`` for multiples of 1,024, else the number."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)
