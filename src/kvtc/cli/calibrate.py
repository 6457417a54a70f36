"""``kvtc calibrate``: fit a calibration, with a :class:`~kvtc.calibration.Recipe` built from the options."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..errors import KVTCError
from ..textsafe import printable
from .common import DEFAULT_MODEL, check_out, positive_float, positive_int, ratio_value

DEFAULT_CORPUS = "sotu-pre2000"
#: written out (importing the recipe would import torch only to print --help); a test holds it to DEFAULT_RATIOS
RATIOS_HELP = "target ratios to plan (default 4 6 7 7.5 8 10 12 16 18 24 32 36 48 64 72 96 144 192)"


def add_calibrate(sub: Any) -> None:
    # defaults resolve at run time: importing transformers only to print --help would take seconds
    p = sub.add_parser("calibrate", help="fit a calibration (PCA bases + bit plans) for a model on a corpus",
                       description="Run a model over a corpus and fit KVTC's PCA bases and bit plans.")  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="hub id, local HF directory, or an embedded model: 'default' (SmolLM2-135M-Instruct), "
                        "'smollm2', 'gemma3' (Gemma-3-270M)")  # fmt: skip
    p.add_argument(
        "--corpus",
        nargs="+",
        default=[DEFAULT_CORPUS],
        help="text files, or one builtin corpus: sotu-pre2000 (default), sotu-2000on, wikipedia",
    )
    p.add_argument("--tokens", type=int, help="calibration tokens (default 100,000)")
    p.add_argument("--ratios", type=ratio_value, nargs="+", help=RATIOS_HELP)
    p.add_argument(
        "--value-weight",
        type=positive_float,
        default=None,
        help="weight of the values' relative error in the joint split (default 2)",
    )
    p.add_argument(
        "--sensitivity",
        choices=("fisher", "none"),
        default="fisher",
        help="fisher: weigh each cached feature by the loss's measured sensitivity before the PCA "
        "and DP (default); none: the paper's plain squared error",
    )
    p.add_argument(
        "--types",
        default="all",
        help="quantization types the DP may use, comma-separated: all (the default set: the paper's int2, int4, "
        "fp8 plus our int3, scale-only int1s, int2s, int3s, int4s, fp8s and fixed-step int2f, int4f, int8f), r9 "
        "(all but the fixed-step ones), paper (int2, int4, fp8 only), type names, or a mix such as paper,int2s",
    )
    p.add_argument(
        "--queries",
        choices=("keys", "none"),
        default="keys",
        help="keys: record each attention head's mean query and a map predicting a token's query from its key, so "
        "that encoders spend more bits on the tokens the newest tokens' (predicted) queries read (token-adaptive "
        "rates; default); none: every middle token gets the same plan",
    )
    p.add_argument(
        "--token-map",
        choices=("auto", "off"),
        default="auto",
        help="code each token's K/V less a linear prediction from its token ids (the blob then carries the ids, and "
        "encoding and decoding need the model's input embeddings): auto (default) fits the map and keeps it where "
        "it saves enough distortion on held-out windows (Gemma-3-270M and SmolLM2-135M: kept); off",
    )
    p.add_argument(
        "--forward",
        choices=("bfloat16", "model"),
        default="bfloat16",
        help="the precision of the forward pass that reads the calibration's K/V: bfloat16 (default) runs the "
        "model's matrix products in bfloat16 under autocast (1.7-3x faster on CPUs with bf16 instructions, K/V "
        "within about 0.4%% of float32's); model: as the model runs",
    )
    p.add_argument("--window", type=positive_int, help="tokens per calibration window (default 1,024)")
    p.add_argument(
        "--out",
        type=Path,
        help="calibration file to write (default model, corpus and recipe: the cached default calibration)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("--device", default="cpu")
    p.set_defaults(run=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from .. import assets
    from ..calibration.artifact import Calibration
    from ..calibration.load import embedded_model_key
    from ..integrations.hf_calibrate import calibrate_model, default_calibration

    recipe = recipe_from_args(args)
    check_out(args.out, "calibration file")
    t0 = time.perf_counter()
    embedded = embedded_model_key(args.model)
    default_data = embedded is not None and args.corpus == [DEFAULT_CORPUS] and args.out is None
    if default_data and recipe.name is not None:
        # the embedded model's cached default of that recipe, built once
        path = default_calibration(recipe, progress=True, model=embedded)
    else:
        if args.out is None:
            raise KVTCError(
                "--out is required unless the model, the corpus and the recipe options are the defaults "
                "(the cached default calibration); e.g. --out my.safetensors"
            )
        if args.out.exists() and not args.force:
            raise KVTCError(
                f"{args.out} exists; pass --force to replace it (it is only replaced once the new one is complete)"
            )
        corpus = args.corpus[0] if len(args.corpus) == 1 and args.corpus[0] in assets.BUILTIN_CORPORA else args.corpus
        texts = assets.corpus(corpus)
        if not any(t.strip() for t in texts):
            raise KVTCError(f"the corpus {args.corpus} holds no text; give text files or a builtin corpus")
        model, tok = assets.load_model(args.model, device=args.device)
        name = assets.embedded_model(embedded).name if embedded is not None else str(args.model)
        cal = calibrate_model(
            model,
            tok,
            texts,
            recipe,
            model_id=name,
            progress=True,
            corpus={"name": corpus if isinstance(corpus, str) else "files", "documents": len(texts)},
        )
        path = cal.save(args.out)
    cal = Calibration.load(path)
    _summary(cal, path, time.perf_counter() - t0)
    return 0


def _obj(value: Any) -> dict[str, Any]:
    """A free-form metadata field (a calibration's ``corpus`` or ``stats`` entry) as a dict: {} unless it is one."""
    return value if isinstance(value, dict) else {}


def _num(value: Any, spec: str) -> str:
    """A number from free-form metadata formatted with ``spec``, or the value escaped when it is not a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return printable(value, 40)


def _summary(cal: Any, path: Path, seconds: float) -> None:
    """Print what a calibration holds. Its free-form metadata (``corpus``, ``stats``) and model id come from the
    file: every string of them is printed escaped and a field of the wrong type is shown, never an error."""
    from ..quant import DROP, TYPE_NAMES

    p = printable
    secs = _obj(cal.stats.get("seconds"))
    print(f"calibration: {p(path, None)}")
    print(
        f"  model {p(cal.model_id) or '?'}, layout {len(cal.layout.layers)} layers x {cal.layout.num_kv_heads} KV "
        f"heads x {cal.layout.head_dim}, ratios {', '.join(f'{r:g}' for r in cal.ratios)}, hash {p(cal.fingerprint)}"
    )
    sens = _obj(cal.corpus.get("sensitivity"))
    weighting = f"sensitivity ({p(sens.get('method', '?'), 40)})" if cal.weighted else "none (plain squared error)"
    print(f"  weighting: {weighting}")
    used = sorted(
        {
            TYPE_NAMES[t]
            for by_kind in cal.plans.values()
            for pls in by_kind.values()
            for pl in pls
            for _, t, _ in pl.segments
            if t != DROP
        }
    )
    print(f"  quantization types in the plans: {', '.join(used) or 'none'}")
    if cal.queries is not None:
        from ..codec.tiers import auto_pair, ladder_rungs

        tiered = [r for r in cal.ratios if ladder_rungs(cal, r) is not None or auto_pair(cal, r) is not None]
        what = "mean queries and key-to-query map" if cal.query_map is not None else "mean queries"
        print(f"  {what}: recorded; token-adaptive rates at {', '.join(f'{r:g}x' for r in tiered) or 'no ratio'}")
    else:
        print("  mean queries: not recorded (one plan for every middle token)")
    notes = _obj(cal.corpus.get("token_map"))
    if cal.token_map is not None:
        g = cal.token_map.gain
        saves = (
            f"; saves {50 * (g['keys'] + g['values']):.0f}% of the distortion" if {"keys", "values"} <= set(g) else ""
        )
        print(f"  token map: kept ({cal.token_map.lags} tokens per prediction{saves}): blobs carry the token ids")
    elif _obj(notes.get("gain")):
        g = _obj(notes.get("gain"))
        k, v = g.get("keys"), g.get("values")
        share = (
            f"{100 * (k + v) / 2:.0f}%"
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (k, v))
            else f"keys {p(k, 40)}, values {p(v, 40)}"
        )
        print(f"  token map: left out (would save {share} of the distortion)")
    print(f"  built in {_num(secs.get('total', '?'), '')} s; this run {seconds:.1f} s")


def recipe_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~kvtc.calibration.Recipe` the options ask for (an option left out keeps the recipe's default)."""
    from ..calibration.recipe import Recipe

    given = {name: getattr(args, name) for name in ("tokens", "ratios", "window", "value_weight")}
    return Recipe(
        sensitivity=args.sensitivity,
        queries=args.queries,
        token_map=args.token_map,
        forward=args.forward,
        types=parse_types(args.types),
        **{k: v for k, v in given.items() if v is not None},
    )


def parse_types(spec: str) -> tuple[int, ...]:
    """Comma-separated ``all`` (the default set), ``paper`` and type names -> DP type codes, e.g. ``paper,int2s``."""
    from ..calibration.dp import DEFAULT_TYPES, PAPER_TYPES, R9_TYPES
    from ..quant import DROP, TYPE_CODES

    sets = {"all": DEFAULT_TYPES, "paper": PAPER_TYPES, "r9": R9_TYPES}
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in sets and (n not in TYPE_CODES or TYPE_CODES[n] == DROP)]
    if bad or not names:
        raise KVTCError(
            f"unknown quantization type(s) {', '.join(bad) or spec!r}; use all, r9, paper, names from "
            f"{', '.join(n for n, c in TYPE_CODES.items() if c != DROP)}, or a comma-separated mix (paper,int2s)"
        )
    return tuple(dict.fromkeys(c for n in names for c in sets.get(n, (TYPE_CODES.get(n, DROP),))))
