"""``kvtc bench``: on this machine and model, when does compression pay, and which ratio should run?

Loaded by :mod:`kvtc.cli` through :func:`register`. Definitions of every figure: :mod:`kvtc.bench.arith` and
docs/BENCH.md.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import Any

from .arith import BANDWIDTH_EXAMPLES, format_tokens, parse_bandwidths, parse_ratios, parse_token_list

#: defaults per device: contexts, prefill / encode / decode repetitions, and calibration rows for random weights
DEFAULTS = {
    "cpu": {"contexts": "1k,2k,4k", "prefill": 1, "encode": 1, "decode": 2, "calibration_tokens": 4096},
    "cuda": {"contexts": "2k,8k,32k", "prefill": 3, "encode": 3, "decode": 5, "calibration_tokens": 32768},
}
DEFAULT_RATIOS = "8,16,32"
DEFAULT_LINKS = "10GB/s,1GB/s,100MB/s"


def _typed(parse: Any, what: str) -> Any:
    """An argparse type from a parser that raises ValueError (argparse then prints one ``kvtc: error:`` line)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = what
    return convert


def _links(text: str) -> list[tuple[str, float]]:
    return list(zip((x.strip() for x in text.split(",")), parse_bandwidths(text)))


def _reps(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
    if not 1 <= n <= 100:
        raise argparse.ArgumentTypeError(f"{text[:40]} repetitions: give 1 to 100")
    return n


def _rows(text: str) -> int:
    n = int(text) if text.strip().isdigit() else -1
    if not 64 <= n <= 1 << 22:
        raise ValueError(f"{text[:40]!r}: give a whole number of rows from 64 to {1 << 22}")
    return n


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="on this machine and model: when does compression pay, and at which ratio",
        description=(
            "Measure prefill per context, encode / decode time and blob size per ratio (and projection precision "
            "on a GPU), then report per ratio the break-even link bandwidths against recompute and raw 16-bit "
            "transfer, the time to first token of each path at the given links and the cache capacity multiplier. "
            "Writes DIR/bench.json (and DIR/bench.png with --plot)."
        ),
    )
    p.add_argument("--model", default="default", help="HF model dir, hub id, or an embedded model: default, gemma3")
    p.add_argument(
        "--calibration",
        help="calibration file (default: the embedded model's own; with --random-weights, one fitted here)",
    )
    p.add_argument(
        "--random-weights",
        metavar="CONFIG",
        help="measure a random-weight model of this shape instead of --model: a preset (llama-3.1-8b, tiny) or a "
        "config.json (file or directory); calibrated here on its own KV unless --calibration is given",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N")
    p.add_argument(
        "--ratios", type=_typed(parse_ratios, "ratios"), help=f"target ratios, e.g. {DEFAULT_RATIOS} (default)"
    )
    p.add_argument(
        "--contexts",
        type=_typed(parse_token_list, "contexts"),
        help="context lengths (K = 1,024 tokens); default 1k,2k,4k on cpu, 2k,8k,32k on cuda, capped at the "
        "model's maximum",
    )
    p.add_argument(
        "--link",
        type=_typed(_links, "links"),
        default=None,
        help=f"link bandwidths for the TTFT columns ({BANDWIDTH_EXAMPLES}; default {DEFAULT_LINKS})",
    )
    p.add_argument(
        "--repeats",
        type=_reps,
        help="timed runs per measurement (default: prefill 1, encode 1, decode 2 on cpu; 3, 3, 5 on cuda)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=_typed(_rows, "rows"),
        help="rows of a calibration fitted for --random-weights (default 4096 on cpu, 32768 on cuda)",
    )
    p.add_argument("--out", type=Path, default=Path("kvtc-bench"), help="output folder (default: ./kvtc-bench)")
    p.add_argument("--plot", action="store_true", help="also write bench.png (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=main)
    return p


def main(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..progress import StageTimer
    from . import report
    from .measure import Plan, gpu_backend, gpu_precisions, run
    from .model import config_path, load, max_context, resolve_device

    if args.plot:
        report.check_plot()
    if args.random_weights is not None:
        if args.model != "default":
            raise ConfigError("--random-weights builds the model it measures: give it or --model, not both")
        config_path(args.random_weights)
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory; give a folder for bench.json")
    device = resolve_device(args.device)
    import torch

    defaults = DEFAULTS[device.type]
    ratios = args.ratios or parse_ratios(DEFAULT_RATIOS)
    contexts = args.contexts or parse_token_list(defaults["contexts"])
    links = args.link or _links(DEFAULT_LINKS)
    progress = not args.no_progress
    timer = StageTimer(cuda_sync=device.type == "cuda")
    say = (lambda msg: print(f"kvtc bench: {msg}", file=sys.stderr, flush=True)) if progress else (lambda _m: None)

    say(f"loading {args.random_weights and 'random weights: ' + args.random_weights or args.model} on {device}")
    with timer("load"):
        loaded = load(
            args.model,
            args.calibration,
            device,
            args.random_weights,
            ratios,
            args.calibration_tokens or defaults["calibration_tokens"],
            progress,
        )
    planned = [float(r) for r in loaded.calibration.ratios]
    missing = [r for r in ratios if r not in planned]
    if missing:
        raise ConfigError(
            f"--ratios {','.join(f'{r:g}' for r in missing)}: the calibration has no plan for them; it has "
            f"{','.join(f'{r:g}' for r in planned)}"
        )
    notes = []
    cap = max_context(loaded.model)
    if cap is not None and any(n > cap for n in contexts):
        dropped = [n for n in contexts if n > cap]
        contexts = tuple(n for n in contexts if n <= cap)
        notes.append(f"contexts {','.join(map(format_tokens, dropped))} left out: the model's maximum is {cap} tokens")
        if not contexts:
            raise ConfigError(f"--contexts: every length is above the model's maximum of {cap} tokens")
    if device.type == "cuda":
        precisions, skipped = gpu_precisions(device)
        notes += [f"precision {p} not measured: {why}" for p, why in skipped.items()]
        backend = gpu_backend(device)
    else:
        from ..coding.entropy import DEFAULT_BACKEND

        precisions, backend = ("fp32",), DEFAULT_BACKEND
    reps = args.repeats
    plan = Plan(
        contexts=contexts,
        ratios=ratios,
        precisions=precisions,
        backend=backend,
        prefill_reps=reps or defaults["prefill"],
        encode_reps=reps or defaults["encode"],
        decode_reps=reps or defaults["decode"],
        warmup=1 if device.type == "cuda" else 0,
    )
    say(
        f"measuring contexts {','.join(map(format_tokens, contexts))} x ratios "
        f"{','.join(f'{r:g}' for r in ratios)} x precisions {','.join(precisions)}"
    )
    measured = run(loaded, plan, device, progress, timer)
    rows = report.derive(measured, links)
    cal = loaded.calibration
    result: dict[str, Any] = {
        "arguments": {k: _plain(v) for k, v in vars(args).items() if k not in ("run", "command")},
        "model": loaded.name,
        "random_weights": loaded.random,
        "layout": cal.layout.to_dict(),
        "machine": _machine(device, torch),
        "calibration": {
            "name": loaded.calibration_name,
            "fingerprint": cal.fingerprint,
            "ratios": planned,
            "samples": cal.stats.get("samples"),
        },
        "config": {
            "contexts": list(contexts),
            "ratios": list(ratios),
            "precisions": list(precisions),
            "backend": backend,
            "links": [{"link": t, "Bps": b} for t, b in links],
            "repetitions": {"prefill": plan.prefill_reps, "encode": plan.encode_reps, "decode": plan.decode_reps},
            "warmup_runs": plan.warmup,
            "model_dtype": str(loaded.model.dtype).removeprefix("torch."),
            "kv_storage_dtype": "bfloat16",
        },
        "definitions": report.DEFINITIONS,
        "prefill": measured["prefill"],
        "codec": rows,
        "quality": report.quality(cal, ratios, loaded.random),
        "notes": notes,
    }
    result["recommendation"] = report.recommendations(rows, measured["prefill"])
    result["seconds"] = {**timer.rounded(), "total": round(timer.elapsed(), 2)}
    path = report.write_json(result, args.out)
    print(report.text(result))
    print(f"json: {path}", file=sys.stderr)
    if args.plot:
        print(f"plot: {report.plot(result, args.out)}", file=sys.stderr)
    return 0


def _plain(v: Any) -> Any:
    """An argument as JSON holds it."""
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v if v is None or isinstance(v, bool | int | float | str) else str(v)


def _machine(device: Any, torch: Any) -> dict[str, Any]:
    from .. import __version__

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({torch.get_num_threads()} threads)"
    return {
        "device": name,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "kvtc": __version__,
    }
