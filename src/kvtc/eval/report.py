"""``kvtc eval`` output: the JSON result, a markdown table and a PNG plot (ratio on a log axis against
Δppl and against retrieval accuracy, one curve per method). The markdown escapes every string that may come from
outside (the model's name, the calibration's file name and corpus, a peer's reason to be skipped): see
:func:`kvtc.textsafe.printable`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..textsafe import printable

RATIO_NOTE = (
    "Ratios count the compressed (middle) tokens only, against 16-bit K and V of the tokens each layer's cache "
    "holds (a sliding-window layer: its newest window - 1 tokens): kvtc's bytes are the codec's "
    "from `Codec.inspect` (header, positions, per-token shifts and scales, coded planes); FP8 adds one fp32 "
    "scale per layer and kind; KIVI b-bit stores b bits per value plus a 16-bit scale and zero per group of "
    "32 (keys per channel along tokens, values per token along channels); quanto / HQQ b-bit (transformers' "
    "`QuantizedCache` backends, their default axis 0, group 64) b bits plus a 16-bit scale and zero per group "
    "of 64; StreamingLLM keeps the newest 1/ratio of the compressed span in 16 bits and evicts the rest."
)


def _f(v: Any, digits: int = 3) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def _pct(v: Any) -> str:
    return "" if v is None else f"{v:+.2f}%"


def markdown(result: dict[str, Any]) -> str:
    p = printable
    cfg = result["config"]
    lines = []
    ret = {r["method"]: r for r in result.get("retrieval", [])}
    cal = result["calibration"]
    corpus = cal["corpus"].get("name", "?") if isinstance(cal.get("corpus"), dict) else "?"
    lines.append(
        f"Model {p(result['model'])}, storage round trip on {cfg['windows']} windows of {cfg['context']:,} context + "
        f"{cfg['continuation']} scored tokens of {', '.join(p(t) for t in result['texts'])} text; sinks "
        f"{cfg['sinks']} and the {cfg['window']} newest tokens stay exact; calibration `{p(cal['name'])}` "
        f"({p(cal.get('samples') or '?', 40)} tokens, corpus {p(corpus)})."
    )
    lines.append("")
    copy = next((r for r in result["storage_roundtrip"] if r["curve"] == "exact" and "copy_tokens" in r), None)
    if copy is not None:
        lines.append(
            f"KL is the mean over all scored tokens, p90 and max are over the {cfg['windows']} windows' means; copy "
            f"KL is over the {copy['copy_tokens']} copy tokens of {copy['copy_windows']} windows (continuation "
            "tokens whose bigram occurs in the compressed span but not among the exact tokens before them)."
        )
        lines.append("")
    lines.append(
        "| method | ratio | Δppl | KL(exact‖lossy) | KL p90 | KL max | copy KL | top-1 agree | K rel. err | V rel. err "
        "| pass-key acc. |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = sorted(result["storage_roundtrip"], key=lambda r: (r["curve"] != "exact", r["curve"], r.get("ratio", 0)))
    for r in rows:
        rr = ret.get(r["method"])
        acc = f"{rr['accuracy']:.2f} ({rr['lost_vs_exact']} lost)" if rr else ""
        if r["curve"] == "exact":
            ppl = f"ppl {r['ppl']:.3f}"
            acc = f"{ret['exact']['accuracy']:.2f}" if "exact" in ret else ""
            lines.append(f"| exact | 1 | {ppl} | 0 | 0 | 0 | 0 | 1 | 0 | 0 | {acc} |")
            continue
        lines.append(
            f"| {r['method']} | {r['ratio']:.2f}× | {_pct(r.get('delta_ppl_pct'))} | {_f(r.get('kl'))} | "
            f"{_f(r.get('kl_p90'))} | {_f(r.get('kl_max'))} | {_f(r.get('copy_kl'))} | {_f(r.get('top1_agreement'))} | {_f(r.get('k_rel_error'))} | {_f(r.get('v_rel_error'))} | {acc} |"
        )
    typed = [r for r in rows if "k_rel_error_full" in r]
    if typed:  # a model with sliding-window and full-attention layers: the error of each kind of layer
        lines.append("")
        lines.append("Relative K / V error per kind of layer (sliding-window layers: over the tokens they hold):")
        lines.append("")
        lines.append("| method | K full | V full | K sliding | V sliding |")
        lines.append("|---|---|---|---|---|")
        for r in typed:
            cells = " | ".join(_f(r.get(f"{k}_rel_error_{t}")) for t in ("full", "sliding") for k in "kv")
            lines.append(f"| {r['method']} | {cells} |")
    lines.append("")
    lines.append(RATIO_NOTE)
    if result.get("ablation_calibration"):
        a = result["ablation_calibration"]
        lines.append("")
        lines.append(
            f"Ablations: *per-layer PCA* is one PCA per layer (30 groups) instead of one over all layers, fitted "
            f"on {a['tokens']:,} tokens of the calibration corpus (the global kvtc rows use the full calibration); "
            "*greedy allocator* keeps kvtc's global basis and replaces the DP by a greedy marginal-gain "
            f"allocation measured on 1,024 of those rows; *without entropy coding* is the same codec with the "
            "bit-packed planes stored as they are"
            + (
                "; *without sensitivity weighting* is the default recipe (same corpus and tokens) fitting the "
                "paper's plain squared error instead of the Fisher-weighted one"
                if a.get("unweighted")
                else ""
            )
            + (
                "; *paper's types* keeps kvtc's basis and each kind's bits and re-runs the DP with the paper's "
                "quantization types only (int2, int4, fp8 with min/max parameters; no int3, no scale-only types), "
                "on the same 1,024 rows."
                if "paper_types_fit_s" in a or a.get("cached")
                else "."
            )
        )
        gains = result.get("acceptance", {}).get("ablations", {})
        if gains:
            lines.append("")
            weighted = any(g.get("unweighted_delta_ppl_pct") is not None for g in gains.values())
            paper = any(g.get("paper_types_delta_ppl_pct") is not None for g in gains.values())
            head = (
                "| target | kvtc (global PCA, DP, entropy) | per-layer PCA | greedy allocator | entropy-coding gain |"
            )
            if weighted:
                head += " without sensitivity weighting (KL: weighted → unweighted) |"
            if paper:
                head += " paper's quantization types (ratio; KL: ours → paper's) |"
            lines.append(head)
            lines.append("|---|---|---|---|---|" + ("---|" if weighted else "") + ("---|" if paper else ""))
            for t, g in gains.items():
                line = (
                    f"| {t} | {_pct(g['global_delta_ppl_pct'])} | {_pct(g['per_layer_delta_ppl_pct'])} | "
                    f"{_pct(g['greedy_delta_ppl_pct'])} | ×{g['entropy_gain']:.3f} bytes saved |"
                )
                if weighted:
                    uw = g.get("unweighted_delta_ppl_pct")
                    line += (
                        f" {_pct(uw)} (KL {_f(g.get('global_kl'))} → {_f(g.get('unweighted_kl'))}) |"
                        if uw is not None
                        else " |"
                    )
                if paper:
                    pt = g.get("paper_types_delta_ppl_pct")
                    line += (
                        f" {_pct(pt)} ({g['paper_types_ratio']:.2f}×; KL {_f(g.get('global_kl'))} → "
                        f"{_f(g.get('paper_types_kl'))}) |"
                        if pt is not None
                        else " |"
                    )
                lines.append(line)
    if result.get("conversation"):
        lines.append("")
        lines.append(
            f"Simulated conversation ({cfg['conversation_tokens']:,} tokens teacher-forced, compressed "
            f"every 16 tokens, raw tail 112–128 tokens):"
        )
        lines.append("")
        lines.append("| method | ratio | Δppl | KL | top-1 agree |")
        lines.append("|---|---|---|---|---|")
        for r in result["conversation"]:
            if r["curve"] == "exact":
                continue
            lines.append(
                f"| {r['method']} | {r['ratio']:.2f}× | {_pct(r['delta_ppl_pct'])} | {_f(r['kl'])} | "
                f"{_f(r['top1_agreement'])} |"
            )
    if result.get("retrieval"):
        recs = result.get("retrieval_prompts", [])
        lengths = sorted({p["length"] for p in recs})
        lines.append("")
        lines.append(
            f"Retrieval: {len(recs)} pass-key prompts of {', '.join(map(str, lengths))} tokens "
            f"(needle in a haystack of "
            f"{'evaluation text' if cfg.get('retrieval_haystack') == 'text' else 'the classic repeated filler'}"
            f" at depths "
            f"{', '.join(_f(d) for d in cfg['retrieval_depths'])}; greedy answer, exact match)."
        )
        lines.append("")
        lines.append("| cache | ratio | accuracy | answers lost vs exact |")
        lines.append("|---|---|---|---|")
        for r in result["retrieval"]:
            ratio = f"{r['ratio']:.2f}×" if "ratio" in r else "1"
            lines.append(f"| {r['method']} | {ratio} | {r['accuracy']:.3f} | {r['lost_vs_exact']} |")
    if result.get("needles"):
        lines += _needle_lines(result["needles"])
    missing = [
        name
        for key, name in (
            ("conversation", "the simulated conversation"),
            ("retrieval", "pass-key retrieval"),
            ("needles", "the RULER-style needles"),
        )
        if not result.get(key)
    ]
    if missing:
        lines.append("")
        lines.append(f"Not part of this result: {' and '.join(missing)}.")
    if result.get("skipped"):
        lines.append("")
        for name, why in result["skipped"].items():
            lines.append(f"Skipped {p(name)}: {p(why, 500, backslash=False)}")
    t = result.get("timings_s", {})
    m = result.get("machine", {})
    lines.append("")
    lines.append(
        f"Run time {t.get('total', 0) / 60:.1f} min on {p(m.get('cpu', '?'))} ({m.get('cores', '?')} cores, "
        f"{m.get('torch_threads', '?')} torch threads{', ' + p(m['gpu']) if m.get('gpu') else ''}); stages (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in t.items() if k != "total")
        + "."
    )
    return "\n".join(lines)


def _needle_lines(needles: dict[str, Any]) -> list[str]:
    """The needle table: one row per cache, one column per (kind, length): correct answers of the prompts."""
    rows = needles["rows"]
    cols = sorted({(r["kind"], r["length"]) for r in rows}, key=lambda c: (c[0] != "single", c[1]))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["kind"], r["length"]): r for r in rows}
    lines = [
        "",
        "RULER-style needles in the evaluation text (single: one key-value needle; multi-key: four alike, one "
        "queried; greedy answer, exact match of the seven-digit value): correct answers"
        + (f"; left out (beyond the model's context): {needles['left_out']}" if needles.get("left_out") else "")
        + ".",
        "",
        "| cache | ratio | " + " | ".join(f"{k} {f'{n // 1024}K' if n % 1024 == 0 else n}" for k, n in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for m in methods:
        first = next(r for r in rows if r["method"] == m)
        ratio = f"{first['ratio']:.2f}×" if "ratio" in first else "1"
        cells = [cell.get((m, k, n)) for k, n in cols]
        lines.append(
            f"| {m} | {ratio} | " + " | ".join(f"{c['correct']}/{c['prompts']}" if c else "" for c in cells) + " |"
        )
    return lines


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Two panels: Δppl and pass-key accuracy against ratio (log axis), one curve per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    palette = plt.get_cmap("tab20").colors
    colour: dict[str, Any] = {}
    for ax, key, rows, ylabel in (
        (axes[0], "delta_ppl_pct", result["storage_roundtrip"], "perplexity increase (%)"),
        (axes[1], "accuracy", result.get("retrieval", []), "pass-key accuracy"),
    ):
        curves: dict[str, list[tuple[float, float]]] = {}
        exact = None
        for r in rows:
            if r["curve"] == "exact":
                exact = r.get(key)
                continue
            if key in r and "ratio" in r:
                curves.setdefault(r["curve"], []).append((r["ratio"], r[key]))
        for name, pts in sorted(curves.items()):
            pts.sort()
            style = "-o" if name == "kvtc" else "--s"
            c = colour.setdefault(name, palette[len(colour) % len(palette)])
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                style,
                label=name,
                color=c,
                linewidth=2.5 if name == "kvtc" else 1.2,
            )
        if key == "accuracy" and exact is not None:
            ax.axhline(exact, color="k", linestyle=":", label="exact cache")
        if key == "delta_ppl_pct":
            ax.axhline(0, color="k", linestyle=":")
            ax.set_yscale("symlog", linthresh=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("compression ratio (middle tokens, vs 16-bit)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if curves:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{printable(result['model'])}: quality vs bytes ({', '.join(printable(t) for t in result['texts'])})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: dict[str, Any], out_dir: Path, stem: str = "eval") -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=2, sort_keys=True, default=float) + "\n")
    paths["markdown"].write_text(markdown(result) + "\n")
    png = plot(result, out_dir / f"{stem}.png")
    if png is not None:
        paths["png"] = png
    return paths
