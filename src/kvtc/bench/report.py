"""``kvtc bench``'s results: the derived figures (break-even bandwidths, TTFT per path and link, capacity), the
quality figures the calibration records, the terminal table with its recommendation, bench.json and the plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import KVTCError
from .arith import (
    break_even_bandwidth,
    capacity_multiplier,
    fastest,
    format_bandwidth,
    format_bytes,
    format_seconds,
    format_tokens,
    ttft,
    winning_window,
)

#: what the quality columns say when the calibration holds no held-out measurement of the ratio's quality
NOT_MEASURED = "not measured; run kvtc eval --quick"
#: a recommended ratio is the lowest (best quality) whose compressed TTFT is within this factor of the fastest one
RECOMMEND_SLACK = 1.1

DEFINITIONS = {
    "recompute_ttft": "prefill_s of the context",
    "raw_ttft": "raw_bytes / link (16-bit K and V of every layer's held tokens)",
    "compressed_ttft": "stored_bytes / link + decode_s (blob -> the model's cache, RoPE re-applied)",
    "first_step": "one token's forward step after the cache is in place: the same in every path, left out of each TTFT",
    "break_even_vs_recompute_Bps": "stored / (prefill_s - decode_s): compressed beats recompute on faster links; "
    "null: never (decode_s >= prefill_s)",
    "break_even_vs_raw_Bps": "(raw - stored) / decode_s: compressed beats raw transfer on slower links; null: never",
    "raw_vs_recompute_Bps": "raw / prefill_s: raw transfer beats recompute on faster links",
    "capacity_multiplier": "raw_bytes / stored_bytes",
    "units": "bandwidths in bytes/s (1 GB/s = 1e9), times in seconds, GBps = 1e9 bytes of 16-bit KV per second",
}


def _json_number(x: float | None) -> float | None:
    return None if x is None or math.isinf(x) else x


def derive(measured: dict[str, Any], links: list[tuple[str, float]]) -> list[dict[str, Any]]:
    """The codec rows with their capacity multiplier, break-even bandwidths and TTFT per link."""
    prefill = {r["context"]: r for r in measured["prefill"]}
    out = []
    for row in measured["codec"]:
        pre = prefill[row["context"]]
        raw, stored, t_pre, t_dec = row["raw_bytes"], row["stored_bytes"], pre["prefill_s"], row["decode_s"]
        be = break_even_bandwidth(raw, stored, t_pre, t_dec)
        window = winning_window(be)
        ttfts = []
        for text, bps in links:
            t = ttft(raw, stored, t_pre, t_dec, bps)
            ttfts.append(
                {
                    "link": text,
                    "link_Bps": bps,
                    "recompute_s": t.recompute,
                    "raw_s": t.raw,
                    "compressed_s": t.compressed,
                    "fastest": fastest(t),
                }
            )
        out.append(
            {
                **row,
                "capacity_multiplier": capacity_multiplier(raw, stored),
                "break_even": {
                    "vs_recompute_Bps": _json_number(be.vs_recompute),
                    "vs_raw_Bps": None if be.vs_raw is None else (be.vs_raw if math.isfinite(be.vs_raw) else "any"),
                    "raw_vs_recompute_Bps": _json_number(be.raw_vs_recompute),
                    "compressed_fastest_between_Bps": list(window) if window else None,
                },
                "ttft": ttfts,
            }
        )
    return out


def quality(calibration: Any, ratios: tuple[float, ...], random_weights: bool) -> dict[str, Any]:
    """Per ratio, what the calibration records about its quality, and where that comes from.

    A calibration records no held-out measurement of quality (KL, perplexity): its statistics hold the bit
    allocation's predicted relative reconstruction error per kind (``stats["predicted_relative_error"]``, on its
    own calibration rows, sensitivity-weighted where the calibration is), which is reported as such; KL is
    :data:`NOT_MEASURED`."""
    from ..calibration.artifact import ratio_key

    predicted = calibration.stats.get("predicted_relative_error") or {}
    by_ratio: dict[str, Any] = {}
    for r in ratios:
        rec = predicted.get(ratio_key(r)) or {}
        err = {
            kind: sum(v) / len(v)
            for kind, v in rec.items()
            if isinstance(v, list) and v and all(isinstance(x, int | float) for x in v)
        }
        by_ratio[ratio_key(r)] = {"predicted_relative_error": err or None, "kl": NOT_MEASURED}
    source = (
        "the calibration's stats.predicted_relative_error: the bit allocation's predicted relative K/V "
        "reconstruction error on its own calibration rows (not a held-out measurement); next-token KL: "
        f"{NOT_MEASURED}"
    )
    if random_weights:
        source = "random weights: no quality figure means anything for this model (" + source + ")"
    return {"source": source, "by_ratio": by_ratio}


def recommendations(rows: list[dict[str, Any]], prefill: list[dict[str, Any]]) -> list[str]:
    """One line per link, for the longest context: which path to run and, where compression wins, which ratio."""
    n = max(p["context"] for p in prefill)
    at_n = [r for r in rows if r["context"] == n]
    lines = []
    for i, link in enumerate(at_n[0]["ttft"]) if at_n else ():
        t_pre, t_raw = link["recompute_s"], link["raw_s"]
        best = min(r["ttft"][i]["compressed_s"] for r in at_n)
        pick = min(
            (r for r in at_n if r["ttft"][i]["compressed_s"] <= RECOMMEND_SLACK * best),
            key=lambda r: (r["ratio"], r["ttft"][i]["compressed_s"]),
        )
        t_c = pick["ttft"][i]["compressed_s"]
        name = f"{pick['ratio']:g}x" + (f" ({pick['precision']})" if pick["precision"] != "fp32" else "")
        where = f"at {link['link']} with {format_tokens(n)}-token contexts"
        if t_c < min(t_pre, t_raw):
            lines.append(
                f"{where}, {name} restores in {format_seconds(t_c)} vs {format_seconds(t_pre)} recompute and "
                f"{format_seconds(t_raw)} raw transfer ({t_pre / t_c:.1f}x sooner than recompute; "
                f"{pick['capacity_multiplier']:.1f}x the contexts in the same cache memory)"
            )
        elif t_raw <= t_pre:
            lines.append(
                f"{where}, raw 16-bit transfer ({format_seconds(t_raw)}) beats every ratio (best {name}: "
                f"{format_seconds(t_c)}) and recompute ({format_seconds(t_pre)}); compression still holds "
                f"{pick['capacity_multiplier']:.1f}x the contexts in the same memory"
            )
        else:
            lines.append(
                f"{where}, recomputing ({format_seconds(t_pre)}) beats restoring {name} ({format_seconds(t_c)}) "
                f"and raw transfer ({format_seconds(t_raw)})"
            )
    return lines


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def text(result: dict[str, Any]) -> str:
    """The terminal report: prefill, codec and break-even, TTFT per link, quality, recommendation."""
    rows, prefill = result["codec"], result["prefill"]
    gpu = any(r["precision"] != "fp32" for r in rows)
    out = [
        f"kvtc bench: {result['model']} on {result['machine']['device']}, calibration {result['calibration']['name']}",
        "",
        _table(
            ["context", "prefill (recompute)", "tokens/s", "first step", "raw 16-bit KV"],
            [
                [
                    format_tokens(p["context"]),
                    format_seconds(p["prefill_s"]),
                    f"{p['tokens_per_s']:.0f}",
                    format_seconds(p["first_step_s"]),
                    format_bytes(next(r["raw_bytes"] for r in rows if r["context"] == p["context"])),
                ]
                for p in prefill
            ],
        ),
        "",
        _table(
            ["context", "ratio"]
            + (["precision"] if gpu else [])
            + [
                "stored",
                "capacity",
                "encode",
                "enc GB/s",
                "decode",
                "dec GB/s",
                "beats recompute above",
                "beats raw below",
            ],
            [
                [format_tokens(r["context"]), f"{r['ratio']:g}x"]
                + ([r["precision"]] if gpu else [])
                + [
                    format_bytes(r["stored_bytes"]),
                    f"{r['capacity_multiplier']:.1f}x",
                    format_seconds(r["encode_s"]),
                    format_bandwidth(r["encode_GBps"] * 1e9),
                    format_seconds(r["decode_s"]),
                    format_bandwidth(r["decode_GBps"] * 1e9),
                    format_bandwidth(r["break_even"]["vs_recompute_Bps"]),
                    _raw_text(r["break_even"]["vs_raw_Bps"]),
                ]
                for r in rows
            ],
        ),
        "",
        "time to first token (first step left out; * the fastest path):",
        _table(["context", "path"] + [x["link"] for x in rows[0]["ttft"]], _ttft_rows(rows, prefill, gpu)),
        "",
        "quality: " + result["quality"]["source"],
    ]
    for key, q in result["quality"]["by_ratio"].items():
        err = q["predicted_relative_error"]
        e = ", ".join(f"{k} {v:.4f}" for k, v in err.items()) if err else "not recorded"
        out.append(f"  {key}x: predicted relative error {e}; next-token KL {q['kl']}")
    for note in result.get("notes", []):
        out.append(f"note: {note}")
    out.append("")
    out += [f"recommendation: {line}" for line in result["recommendation"]]
    return "\n".join(out)


def _raw_text(v: float | str | None) -> str:
    return "any" if v == "any" else format_bandwidth(v)  # type: ignore[arg-type]


def _ttft_rows(rows: list[dict[str, Any]], prefill: list[dict[str, Any]], gpu: bool) -> list[list[str]]:
    out = []
    for p in prefill:
        at_n = [r for r in rows if r["context"] == p["context"]]
        links = at_n[0]["ttft"]
        best = [
            min(x["recompute_s"], x["raw_s"], *(r["ttft"][i]["compressed_s"] for r in at_n))
            for i, x in enumerate(links)
        ]
        mark = lambda t, i, best=best: format_seconds(t) + ("*" if t <= best[i] else " ")
        ctx = format_tokens(p["context"])
        out.append([ctx, "recompute"] + [mark(x["recompute_s"], i) for i, x in enumerate(links)])
        out.append([ctx, "raw 16-bit"] + [mark(x["raw_s"], i) for i, x in enumerate(links)])
        for r in at_n:
            name = f"kvtc {r['ratio']:g}x" + (f" {r['precision']}" if gpu else "")
            out.append([ctx, name] + [mark(x["compressed_s"], i) for i, x in enumerate(r["ttft"])])
    return out


def write_json(result: dict[str, Any], out: Path) -> Path:
    from ..fileio import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    return write_atomic(out / "bench.json", (json.dumps(result, indent=1) + "\n").encode())


def check_plot() -> None:
    """Fail before measuring when ``--plot`` cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KVTCError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None


def plot(result: dict[str, Any], out: Path) -> Path:
    """TTFT against link bandwidth per path, for the longest context: recompute (flat), raw transfer, kvtc per
    ratio; the measured links marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(p["context"] for p in result["prefill"])
    t_pre = next(p["prefill_s"] for p in result["prefill"] if p["context"] == n)
    rows = [r for r in result["codec"] if r["context"] == n]
    links = [x["link_Bps"] for x in rows[0]["ttft"]]
    crossings = [
        v for r in rows for v in r["break_even"].values() if isinstance(v, float) and math.isfinite(v) and v > 0
    ]  # so that every break-even point is in the picture
    lo, hi = min(links + crossings + [1e7]) / 3, max(links + crossings + [1e11]) * 3
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.plot(xs, [t_pre] * len(xs), "k--", label=f"recompute ({format_seconds(t_pre)})")
    raw = rows[0]["raw_bytes"]
    ax.plot(xs, [raw / b for b in xs], color="gray", label="raw 16-bit transfer")
    for r in rows:
        label = f"kvtc {r['ratio']:g}x" + (f" {r['precision']}" if r["precision"] != "fp32" else "")
        ax.plot(xs, [r["stored_bytes"] / b + r["decode_s"] for b in xs], label=label)
    for b, x in zip(links, rows[0]["ttft"]):
        ax.axvline(b, color="lightgray", lw=0.8)
        ax.text(b, 0.02, f" {x['link']}", transform=ax.get_xaxis_transform(), rotation=90, fontsize=7, va="bottom")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth (bytes/s)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{result['model']}, {format_tokens(n)} context, {result['machine']['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
