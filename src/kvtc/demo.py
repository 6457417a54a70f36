"""``kvtc demo``: the whole story on an embedded model (``--model``: SmolLM2 by default, or Gemma-3-270M), offline.

Calibrate the model on the pre-2000 State of the Union speeches if its default calibration is not
cached; take a held-out document (a speech from 2000 on, or a Wikipedia article) and cut a window of
``--context`` + ``--score`` tokens from it. Quality comes from ``kvtc eval``'s storage round trip
(:func:`kvtc.eval.protocols.storage_roundtrip`): the context's cache is compressed at each target ratio, the
blob is saved to a file and read back, decoded, and the next ``--score`` tokens of the document are fed on top
of it (teacher-forced) against the exact cache. Then each file is restored with
:func:`~kvtc.integrations.hf.restore_cache` and continued greedily, timing restore + first token
against recomputing the prefix. For each ratio: bf16 size, compressed size, achieved ratios, those times,
perplexity of the document's continuation with the exact and the restored cache, top-1 agreement between the
two, and the first greedy lines of both. Writes ``kvtc-demo.md`` (the table), ``kvtc-demo.json`` and
``kvtc-demo.png`` (ratio against quality) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import KVTCError
from .progress import StageTimer, bar
from .textsafe import message, printable

if TYPE_CHECKING:
    import torch

#: the table's ratios, the paper's headline range
DEFAULT_RATIOS = (8.0, 16.0, 32.0)
DEFAULT_CONTEXT = 2048
#: teacher-forced tokens fed after the context (each but the last predicts the next one, which is scored)
DEFAULT_SCORE = 256
#: greedy tokens shown for the exact and each restored cache
DEFAULT_GENERATE = 40
DEFAULT_OUT = Path("out")
HELD_OUT = ("sotu-2000on", "wikipedia")
#: the storage dtype of the files, as :func:`~kvtc.integrations.hf.compress_cache` writes them
STORAGE_DTYPE = "bfloat16"
#: the embedded models' keys (kvtc.assets.EMBEDDED_MODELS, the default first), spelled here so --help imports no torch
EMBEDDED_KEYS = ("smollm2", "gemma3")
#: attention sinks and recent window kept exact (the codec's defaults)
SINKS, WINDOW = 4, 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default %(default)s/)")
    p.add_argument("--ratios", type=float, nargs="+", default=list(DEFAULT_RATIOS))
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="context tokens (default %(default)s)")
    p.add_argument("--score", type=int, default=DEFAULT_SCORE, help="teacher-forced tokens fed after it")
    p.add_argument("--generate", type=int, default=DEFAULT_GENERATE, help="greedy tokens shown per cache")
    p.add_argument("--document", choices=HELD_OUT, default=HELD_OUT[0], help="held-out text (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which held-out window")
    p.add_argument(
        "--model",
        choices=EMBEDDED_KEYS,
        default=EMBEDDED_KEYS[0],
        help="the embedded model (default %(default)s; each has its own default calibration)",
    )
    p.add_argument("--calibration", type=Path, help="a calibration file for the model instead of its default one")
    p.add_argument(
        "--calibration-tokens", type=int, help="tokens of the default calibration (default 100,000; built once, cached)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from .calibration.artifact import Calibration
    from .errors import CalibrationError
    from .integrations.hf_calibrate import DEFAULT_TOKENS, Recipe, default_calibration

    if args.context <= SINKS + WINDOW or args.score < 2 or args.generate < 1:
        raise KVTCError(
            f"--context must exceed the {SINKS} sinks + {WINDOW} window tokens kept exact, --score must "
            f"be at least 2 and --generate at least 1; got {args.context}, {args.score}, {args.generate}"
        )
    timer = StageTimer()
    with timer("calibration (load, or build once)"):
        recipe = Recipe(tokens=args.calibration_tokens or DEFAULT_TOKENS)
        cal_path = args.calibration or default_calibration(recipe, model=args.model)
        cal = Calibration.load(cal_path)
    missing = [r for r in args.ratios if r not in cal.ratios]
    if missing:
        raise CalibrationError(
            f"the calibration has plans for ratios {cal.ratios}, not {missing}; pick --ratios among those"
        )
    import torch

    with torch.inference_mode():
        return _run(args, cal, timer)


def _run(args: argparse.Namespace, cal: Any, timer: StageTimer) -> dict[str, Any]:
    from . import assets
    from .codec import Codec
    from .eval.decode import greedy_decode
    from .eval.methods import KVTC
    from .eval.protocols import storage_roundtrip
    from .integrations.hf import load_blob, restore_cache

    with timer("load model"):
        model, tok = assets.load_model(args.model)
    model_id = assets.embedded_model(args.model).name
    with timer("tokenize held-out text"):
        texts = assets.corpus(args.document)
        window = assets.token_windows(tok, texts, args.context + args.score, 1, seed=args.seed)
    ctx, cont = window[:, : args.context], window[:, args.context :]
    _say(
        f"held-out {args.document} window: {args.context} context tokens + {args.score} fed after it; "
        f"calibration {printable(cal.fingerprint)} "
        f"({printable(cal.stats.get('rows', cal.corpus.get('tokens', '?')), 40)} tokens)"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    paths = {r: args.out / f"kvtc-demo-{r:g}x.kvtc" for r in args.ratios}
    emb = model.get_input_embeddings().weight  # for a calibration with a token map (docs/METHOD.md, step 7)
    methods = [
        KVTC(cal, r, dtype=STORAGE_DTYPE, model_id=model_id, store=_through_file(paths[r]), embeddings=emb)
        for r in args.ratios
    ]
    with timer("storage round trip: prefill, compress, save, load, decode, score"):
        with bar(len(methods) + 1, "storage round trip") as progress:
            tallies = storage_roundtrip(model, window, methods, args.context, SINKS, WINDOW, progress)
    # the exact continuation from a full prefill: its first token is what a restore replaces
    with timer("recompute + generate"):
        exact = greedy_decode(model, window[:, : args.context + 1], None, args.generate)

    rows = []
    for m in methods:
        with timer(f"{m.ratio:g}x: restore + generate"):
            t0 = time.perf_counter()
            blob = load_blob(paths[m.ratio])
            restored = restore_cache(blob, model, cal)
            restore_s = time.perf_counter() - t0
            gen = greedy_decode(model, cont[:, :1], restored, args.generate)
        info = Codec.inspect(blob)
        score = tallies[m.label].summary()
        rows.append(
            {
                "target": m.ratio,
                "bf16_bytes": info["original_bytes"],
                "compressed_bytes": len(blob),
                "codec_ratio": info["codec_ratio"],
                "whole_cache_ratio": info["whole_cache_ratio"],
                "coded_tokens": info["middle_tokens"],
                "encode_s": m.timer.seconds["encode"],
                "restore_first_token_s": restore_s + gen.first_s,
                "recompute_s": exact.first_s,
                "ppl_exact": score["ppl_exact"],
                "ppl_restored": score["ppl"],
                "kl": score["kl"],
                "top1_agreement": score["top1_agreement"],
                "greedy_identical_prefix": _common_prefix(gen.tokens, exact.tokens),
                "text": tok.decode(gen.tokens[0], skip_special_tokens=True),
            }
        )
        _say(f"{m.ratio:g}x: codec ratio {info['codec_ratio']:.1f}x, top-1 agreement {score['top1_agreement']:.3f}")

    result = {
        "model": model_id,
        "document": args.document,
        "context_tokens": args.context,
        "scored_tokens": tallies["exact"].tokens,
        "calibration": cal.fingerprint,
        "rows": rows,
        "exact_text": tok.decode(exact.tokens[0], skip_special_tokens=True),
        "context_tail": tok.decode(ctx[0, -48:], skip_special_tokens=True),
        "stages_s": timer.rounded(2),
    }
    md = _markdown(result)
    (args.out / "kvtc-demo.md").write_text(md)
    plot = _plot(rows, args.out / "kvtc-demo.png", model_id)
    result["stages_s"]["total"] = round(timer.elapsed(), 2)
    (args.out / "kvtc-demo.json").write_text(json.dumps(result, indent=2) + "\n")
    print(md)
    print(
        f"wrote {args.out / 'kvtc-demo.md'}, {args.out / 'kvtc-demo.json'}"
        + (f", {plot}" if plot else " (no plot: install matplotlib)")
        + f"; total {result['stages_s']['total']:.0f} s"
    )
    return result


def _through_file(path: Path) -> Callable[[bytes], bytes]:
    """A round trip of a blob through ``path``: written atomically, read back and its header checked."""
    from .integrations.hf import load_blob, save_blob

    def store(blob: bytes) -> bytes:
        return load_blob(save_blob(path, blob))

    return store


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
        f"## kvtc demo: {r['model']}, {r['context_tokens']}-token held-out {r['document']} context",
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
        f"whole bf16 cache. Perplexity over the document's next {r['scored_tokens']} tokens, teacher-forced; "
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
    """Generated or corpus text on one line, with anything a terminal would act on escaped."""
    return message(text, None)


def _plot(rows: list[dict[str, Any]], path: Path, model_id: str) -> Path | None:
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
    ax.set_title(f"kvtc on {model_id}: ratio vs quality")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
