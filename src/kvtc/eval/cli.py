"""``kvtc eval``: quality lost against bytes saved, for kvtc and its peers, on one model.

Loaded by :mod:`kvtc.cli` through :func:`register`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .config import (
    DEFAULT_ABLATION_TOKENS,
    DEFAULT_CONTEXT,
    DEFAULT_CONTINUATION,
    DEFAULT_NEEDLE_PROMPTS,
    DEFAULT_RETRIEVAL_PROMPTS,
    DEFAULT_TEXTS,
    DEFAULT_WINDOWS,
    EvalConfig,
)


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _targets(s: str) -> tuple[float, ...]:
    """``--ratios``: comma-separated targets, or ``all`` (every ratio the calibration plans: an empty tuple)."""
    return () if s.strip().lower() == "all" else _floats(s)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="compare kvtc with FP8, KIVI, quanto/HQQ and token eviction: quality vs bytes",
        description=(
            "Storage round trip (perplexity, KL with its worst window and on copy tokens, top-1, K/V error), the "
            "simulated conversation, pass-key retrieval and RULER-style needles (single and multi-key), for kvtc at 8x to 64x (or every calibrated ratio) and its peers, on the same windows. Writes "
            "eval.json, eval.md and eval.png."
        ),
    )
    p.add_argument(
        "--model",
        default="default",
        help="HF model dir, hub id, or an embedded model: default (SmolLM2), smollm2, gemma3",
    )
    p.add_argument("--calibration", help="calibration file (default: the embedded default's, built once)")
    p.add_argument(
        "--texts",
        nargs="+",
        default=[DEFAULT_TEXTS],
        help="evaluation texts: wikipedia-heldout (the Wikipedia sample less the articles kvtc was tuned on), "
        f"wikipedia, wikipedia-tuning, sotu-2000on, or local text files (default: {DEFAULT_TEXTS})",
    )
    p.add_argument("--windows", type=int, default=DEFAULT_WINDOWS)
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT)
    p.add_argument("--continuation", type=int, default=DEFAULT_CONTINUATION)
    p.add_argument(
        "--ratios",
        type=_targets,
        help="kvtc target ratios, comma separated, or 'all' for every calibrated ratio "
        "(default: 8,16,24,32,48,64, those the calibration plans)",
    )
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument(
        "--no-peers", action="store_true", help="leave out quanto / HQQ and token eviction (FP8 and KIVI stay)"
    )
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--ablation-tokens", type=int, default=DEFAULT_ABLATION_TOKENS)
    p.add_argument("--no-conversation", action="store_true")
    p.add_argument("--no-retrieval", action="store_true")
    p.add_argument("--retrieval-prompts", type=int, default=DEFAULT_RETRIEVAL_PROMPTS)
    p.add_argument("--retrieval-lengths", type=_ints, default=None)
    p.add_argument(
        "--retrieval-haystack",
        choices=("filler", "text"),
        default="filler",
        help="filler: the classic pass-key test (repeated filler sentences, default); "
        "text: the needle hidden in the evaluation text",
    )
    p.add_argument("--no-needles", action="store_true", help="leave out the RULER-style needle prompts")
    p.add_argument(
        "--needle-lengths",
        type=_ints,
        default=None,
        help="context lengths of the needle prompts (default: 4096,8192, those the model's context holds)",
    )
    p.add_argument(
        "--needle-prompts",
        type=int,
        default=DEFAULT_NEEDLE_PROMPTS,
        help=f"needle prompts per kind (single, multi-key) and length (default: {DEFAULT_NEEDLE_PROMPTS})",
    )
    p.add_argument("--quick", action="store_true", help="one window, kvtc 16x and KIVI 2-bit, round trip only")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=Path("kvtc-eval"), help="output folder (default: ./kvtc-eval)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=main)
    return p


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    kw: dict[str, Any] = dict(
        model=args.model,
        calibration=args.calibration,
        texts=tuple(args.texts),
        windows=args.windows,
        context=args.context,
        continuation=args.continuation,
        ratios=args.ratios,
        device=args.device,
        progress=not args.no_progress,
    )
    if args.quick:
        if args.windows == DEFAULT_WINDOWS:
            kw["windows"] = 1
        return EvalConfig.quick_config(**kw)
    if args.no_peers:
        kw.update(peers=(), eviction_ratios=())
    kw.update(
        baselines=not args.no_baselines,
        ablations=not args.no_ablations,
        ablation_tokens=args.ablation_tokens,
        conversation=not args.no_conversation,
        retrieval=not args.no_retrieval,
        retrieval_prompts=args.retrieval_prompts,
        retrieval_haystack=args.retrieval_haystack,
        needles=not args.no_needles,
        needle_prompts=args.needle_prompts,
    )
    if args.retrieval_lengths:
        kw["retrieval_lengths"] = args.retrieval_lengths
    if args.needle_lengths:
        kw["needle_lengths"] = args.needle_lengths
    return EvalConfig(**kw)


def main(args: argparse.Namespace) -> int:
    from . import report
    from .suite import run

    result = run(config_from_args(args))
    paths = report.write(result, args.out)
    print(report.markdown(result))
    for kind, path in paths.items():
        print(f"{kind}: {path}", file=sys.stderr)
    return 0
