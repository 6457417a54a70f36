"""``kvtc demo``: the whole story on the embedded default, offline.

Calibrate SmolLM2-135M-Instruct on the pre-2000 State of the Union speeches if no default calibration is
cached; take a held-out document (a speech from 2000 on, or a Wikipedia article); prefill its first
``--context`` tokens; compress the cache at each target ratio, save it to disk, read it back, restore it and
continue. For each ratio: bf16 size, compressed size, achieved ratios, restore + first-token time against
recomputing the prefix, perplexity of the next ``--score`` tokens of the document (teacher-forced) with the
exact and the restored cache, top-1 agreement between the two, and the first greedy lines of both.
Writes ``kvtc-demo.md`` (the table), ``kvtc-demo.json`` and ``kvtc-demo.png`` (ratio against quality) into
``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

#: the table's ratios, the paper's headline range
DEFAULT_RATIOS = (8.0, 16.0, 32.0)
DEFAULT_CONTEXT = 2048
#: teacher-forced tokens scored after the context
DEFAULT_SCORE = 256
#: greedy tokens shown for the exact and each restored cache
DEFAULT_GENERATE = 40
DEFAULT_OUT = Path("out")
HELD_OUT = ("sotu-2000on", "wikipedia")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default %(default)s/)")
    p.add_argument("--ratios", type=float, nargs="+", default=list(DEFAULT_RATIOS))
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="context tokens (default %(default)s)")
    p.add_argument("--score", type=int, default=DEFAULT_SCORE, help="teacher-forced tokens scored after it")
    p.add_argument("--generate", type=int, default=DEFAULT_GENERATE, help="greedy tokens shown per cache")
    p.add_argument("--document", choices=HELD_OUT, default=HELD_OUT[0], help="held-out text (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which held-out window")
    p.add_argument("--calibration", type=Path, help="a calibration file for SmolLM2 instead of the default one")
    p.add_argument("--calibration-tokens", type=int,
                   help="tokens of the default calibration (default 100,000; built once, cached)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from .calibration.artifact import Calibration
    from .errors import CalibrationError
    from .integrations.hf_calibrate import DEFAULT_TOKENS, Recipe, default_calibration

    stages: dict[str, float] = {}
    t_all = time.perf_counter()
    cal_path = args.calibration or default_calibration(Recipe(tokens=args.calibration_tokens or DEFAULT_TOKENS))
    cal = Calibration.load(cal_path)
    stages["calibration (load, or build once)"] = round(time.perf_counter() - t_all, 2)
    missing = [r for r in args.ratios if r not in cal.ratios]
    if missing:
        raise CalibrationError(f"the calibration has plans for ratios {cal.ratios}, not {missing}; "
                               "pick --ratios among those")
    with torch.inference_mode():
        return _run(args, cal, stages, t_all)


def _run(args: argparse.Namespace, cal: Any, stages: dict[str, float], t_all: float) -> dict[str, Any]:
    from . import assets
    from .codec import Codec
    from .integrations.hf_cache import compress_cache, load_blob, restore_cache, save_blob

    def stage(name: str, t0: float) -> None:
        stages[name] = round(time.perf_counter() - t0, 2)

    t0 = time.perf_counter()
    model, tok = assets.load_model("default")
    stage("load model", t0)

    t0 = time.perf_counter()
    texts = assets.corpus(args.document)
    window = assets.token_windows(tok, texts, args.context + args.score, 1, seed=args.seed)
    ctx, cont = window[:, : args.context], window[:, args.context :]
    stage("tokenize held-out text", t0)
    _say(f"held-out {args.document} window: {args.context} context tokens + {args.score} scored; "
         f"calibration {cal.fingerprint} ({cal.stats.get('rows', cal.corpus.get('tokens', '?'))} tokens)")

    # The exact reference: the prefill whose cache is compressed, then the document's next tokens.
    t0 = time.perf_counter()
    exact_cache = model(ctx, use_cache=True).past_key_values
    stage("prefill context", t0)
    recompute_s = _time_recompute(model, ctx, cont)
    exact = _continue(model, _clone(exact_cache), cont)
    exact_gen = _greedy(model, _clone(exact_cache), cont[:, :1], args.generate)
    args.out.mkdir(parents=True, exist_ok=True)

    rows = []
    for ratio in args.ratios:
        t_ratio = t0 = time.perf_counter()
        blob = compress_cache(exact_cache, model, Codec(cal, ratio=ratio))
        encode_s = time.perf_counter() - t0
        path = save_blob(args.out / f"kvtc-demo-{ratio:g}x.kvtc", blob)
        # restore + first token: read the file, decode, rebuild, one forward of the first new token
        t0 = time.perf_counter()
        restored = restore_cache(load_blob(path), model, cal)
        model(cont[:, :1], past_key_values=restored, use_cache=True)
        ttft_s = time.perf_counter() - t0
        restored.crop(-1)
        got = _continue(model, restored, cont)
        restored.crop(-cont.shape[1])
        gen = _greedy(model, restored, cont[:, :1], args.generate)
        info = Codec.inspect(blob)
        rows.append({
            "target": ratio,
            "bf16_bytes": info["original_bytes"],
            "compressed_bytes": len(blob),
            "codec_ratio": info["codec_ratio"],
            "whole_cache_ratio": info["whole_cache_ratio"],
            "coded_tokens": info["middle_tokens"],
            "encode_s": encode_s,
            "restore_first_token_s": ttft_s,
            "recompute_s": recompute_s,
            "ppl_exact": exact["ppl"],
            "ppl_restored": got["ppl"],
            "top1_agreement": float((got["argmax"] == exact["argmax"]).float().mean()),
            "greedy_identical_prefix": _common_prefix(gen, exact_gen),
            "text": tok.decode(gen[0], skip_special_tokens=True),
        })
        stages[f"{ratio:g}x: compress, save, restore, score, generate"] = round(time.perf_counter() - t_ratio, 2)
        _say(f"{ratio:g}x done: codec ratio {info['codec_ratio']:.1f}x, top-1 agreement {rows[-1]['top1_agreement']:.3f}")

    result = {
        "document": args.document, "context_tokens": args.context, "scored_tokens": args.score,
        "calibration": cal.fingerprint, "rows": rows, "exact_text": tok.decode(exact_gen[0], skip_special_tokens=True),
        "context_tail": tok.decode(ctx[0, -48:], skip_special_tokens=True), "stages_s": stages,
    }
    md = _markdown(result)
    (args.out / "kvtc-demo.md").write_text(md)
    plot = _plot(rows, args.out / "kvtc-demo.png")
    stages["total"] = round(time.perf_counter() - t_all, 2)
    (args.out / "kvtc-demo.json").write_text(json.dumps(result, indent=2) + "\n")
    print(md)
    print(f"wrote {args.out / 'kvtc-demo.md'}, {args.out / 'kvtc-demo.json'}" + (f", {plot}" if plot else
          " (no plot: install matplotlib)") + f"; total {stages['total']:.0f} s")
    return result


# ---------------------------------------------------------------------- measurements


def _clone(cache: Any) -> Any:
    """An independent copy of a cache (forward passes append to the one they are given)."""
    return copy.deepcopy(cache)


def _time_recompute(model: Any, ctx: torch.Tensor, cont: torch.Tensor) -> float:
    """Prefill of the context plus the first new token, from nothing: what a restore replaces."""
    t0 = time.perf_counter()
    model(torch.cat([ctx, cont[:, :1]], dim=1), use_cache=True)
    return time.perf_counter() - t0


def _continue(model: Any, cache: Any, cont: torch.Tensor) -> dict[str, Any]:
    """Teacher-forced logits of ``cont`` after the cache: perplexity of cont[1:] and the argmax at each step."""
    logits = model(cont, past_key_values=cache, use_cache=True).logits[0].float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], cont[0, 1:])
    return {"ppl": math.exp(float(nll)), "argmax": logits.argmax(-1)}


def _greedy(model: Any, cache: Any, first: torch.Tensor, n: int) -> torch.Tensor:
    step, out = first, []
    for _ in range(n):
        step = model(step, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        out.append(step)
    return torch.cat(out, dim=1)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    same = (a[0] == b[0]).long()
    return int(same.cumprod(0).sum())


# ---------------------------------------------------------------------- output


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _markdown(r: dict[str, Any]) -> str:
    rows = r["rows"]
    lines = [
        f"## kvtc demo: SmolLM2-135M-Instruct, {r['context_tokens']}-token held-out {r['document']} context",
        "",
        "| target | bf16 KV | compressed | codec ratio | whole-cache ratio | restore + 1st token | recompute | "
        "ppl exact | ppl restored | Δppl | top-1 agreement | greedy tokens identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append(
            f"| {x['target']:g}x | {_mb(x['bf16_bytes'])} | {_mb(x['compressed_bytes'])} | {x['codec_ratio']:.1f}x | "
            f"{x['whole_cache_ratio']:.1f}x | {x['restore_first_token_s']:.2f} s | {x['recompute_s']:.2f} s | "
            f"{x['ppl_exact']:.2f} | {x['ppl_restored']:.2f} | {100 * (x['ppl_restored'] / x['ppl_exact'] - 1):+.1f}% | "
            f"{x['top1_agreement']:.3f} | {x['greedy_identical_prefix']} |"
        )
    lines += [
        "",
        f"Codec ratio: the {rows[0]['coded_tokens']} coded tokens (the 4 sinks and 128 newest tokens stay bf16), every header and section counted; whole-cache ratio: the entire blob against the "
        f"whole bf16 cache. Perplexity over the document's next {r['scored_tokens'] - 1} tokens, teacher-forced; "
        "top-1 agreement: the restored cache's argmax equals the exact cache's.",
        "",
        f"Context ends: …{_one_line(r['context_tail'])}",
        "",
        f"- exact: {_one_line(r['exact_text'])}",
    ]
    lines += [f"- {x['target']:g}x: {_one_line(x['text'])}" for x in rows]
    lines += ["", "Stages (s): " + ", ".join(f"{k} {v}" for k, v in r["stages_s"].items())]
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ratios = [x["codec_ratio"] for x in rows]
    dppl = [100 * (x["ppl_restored"] / x["ppl_exact"] - 1) for x in rows]
    agree = [x["top1_agreement"] for x in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(ratios, dppl, "o-", color="tab:red", label="perplexity change (%)")
    for x, y, r in zip(ratios, dppl, rows):
        ax.annotate(f"{r['target']:g}x target", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("achieved codec ratio (after entropy coding)")
    ax.set_ylabel("perplexity change vs exact cache (%)", color="tab:red")
    ax.axhline(0, color="grey", lw=0.5)
    ax2 = ax.twinx()
    ax2.plot(ratios, agree, "s--", color="tab:blue", label="top-1 agreement")
    ax2.set_ylabel("top-1 agreement with exact", color="tab:blue")
    ax2.set_ylim(0, 1.02)
    ax.set_title("kvtc on SmolLM2-135M-Instruct: ratio vs quality")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
