"""``kvtc`` command line: calibrate, compress, generate, inspect, demo (and eval / bench where installed).

Each subcommand is one ``add_<name>(subparsers)`` function that registers its parser and sets ``run`` to a
handler ``(args) -> exit code``. :data:`COMMANDS` lists the built-in ones; :data:`PLUGINS` names modules that
register more with a ``register(subparsers)`` function and are imported only when present. Errors kvtc
raises on purpose (and OS errors) print as one line ``kvtc: error: <message>`` with exit code 2; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import KVTCError

#: exit code of a failed command (argparse uses the same for usage errors)
EXIT_ERROR = 2
#: tokens the default calibration is built on (the embedded default's)
DEFAULT_CALIBRATION = "default"
DEFAULT_MODEL = "default"
DEFAULT_CORPUS = "sotu-pre2000"
#: suffix of the file ``kvtc compress`` writes beside a blob: the token ids the cache stands for
TOKENS_SUFFIX = ".tokens.json"
TOKENS_FORMAT = "kvtc-tokens"


# ------------------------------------------------------------------------------------------- calibrate


def add_calibrate(sub: Any) -> None:
    # defaults resolve at run time: importing transformers only to print --help would take seconds
    p = sub.add_parser("calibrate", help="fit a calibration (PCA bases + bit plans) for a model on a corpus",
                       description="Run a model over a corpus and fit KVTC's PCA bases and bit plans.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="hub id, local HF directory, or 'default' (the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", nargs="+", default=[DEFAULT_CORPUS],
                   help="text files, or one builtin corpus: sotu-pre2000 (default), sotu-2000on, wikipedia")
    p.add_argument("--tokens", type=int, help="calibration tokens (default 100,000)")
    p.add_argument("--ratios", type=float, nargs="+", help="target ratios to plan (default 6 7 7.5 8 10 12 16 24 32 48 64)")
    p.add_argument("--kv-split", choices=("joint", "equal"), default="joint",
                   help="joint: keys and values share one bit budget, split where the weighted relative error "
                        "is least (default); equal: the same budget for each")
    p.add_argument("--value-weight", type=float, default=None,
                   help="weight of the values' relative error in the joint split (default 2)")
    p.add_argument("--sensitivity", choices=("fisher", "none"), default="fisher",
                   help="fisher: weigh each cached feature by the loss's measured sensitivity before the PCA "
                        "and DP (default); none: the paper's plain squared error")
    p.add_argument("--sampling", choices=("spread", "first"), default="spread",
                   help="spread: calibration windows drawn across all the corpus's documents (default); first: "
                        "consecutive windows from its first documents on")
    p.add_argument("--types", default="all",
                   help="quantization types the DP may use: all (default: the paper's int2, int4, fp8 plus our int3 "
                        "and scale-only int2s, int3s, int4s, fp8s), paper (int2, int4, fp8 only: a file older kvtc "
                        "reads), or a comma-separated list of type names")
    p.add_argument("--window", type=int, help="tokens per calibration window (default 1,024)")
    p.add_argument("--out", type=Path,
                   help="calibration file to write (default model and corpus: the cached default calibration)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("--device", default="cpu")
    p.set_defaults(run=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from . import assets
    from .calibration.artifact import Calibration
    from .calibration.fit import DEFAULT_RATIOS
    from .quant import DROP, TYPE_NAMES
    from .integrations.hf_calibrate import DEFAULT_TOKENS, DEFAULT_WINDOW_TOKENS, calibrate_model, default_calibration

    args.tokens = args.tokens or DEFAULT_TOKENS
    args.ratios = args.ratios or list(DEFAULT_RATIOS)
    args.window = args.window or DEFAULT_WINDOW_TOKENS
    is_default = _is_default_model(args.model) and args.corpus == [DEFAULT_CORPUS] and args.out is None
    t0 = time.perf_counter()
    fit_kw: dict = {"kv_split": args.kv_split, "sensitivity": args.sensitivity, "sampling": args.sampling}
    if args.value_weight is not None:
        fit_kw["value_weight"] = args.value_weight
    if args.types != "all":
        fit_kw["types"] = parse_types(args.types)
    if (is_default and sorted(args.ratios) == sorted(DEFAULT_RATIOS) and args.window == DEFAULT_WINDOW_TOKENS
            and args.kv_split == "joint" and args.value_weight is None and args.types == "all"
            and args.sampling == "spread"):
        path = default_calibration(tokens=args.tokens, progress=True, sensitivity=args.sensitivity)
    else:
        if args.out is None:
            raise KVTCError("--out is required unless the model and corpus are the defaults; e.g. --out my.safetensors")
        if args.out.exists() and not args.force:
            raise KVTCError(f"{args.out} exists; pass --force to replace it (it is only replaced once the new one is complete)")
        corpus = args.corpus[0] if len(args.corpus) == 1 and args.corpus[0] in assets.BUILTIN_CORPORA else args.corpus
        texts = assets.corpus(corpus)
        model, tok = assets.load_model(args.model, device=args.device)
        name = assets.DEFAULT_MODEL if _is_default_model(args.model) else str(args.model)
        cal = calibrate_model(model, tok, texts, tokens=args.tokens, ratios=args.ratios, window=args.window,
                              model_id=name, corpus={"name": corpus if isinstance(corpus, str) else "files",
                                                     "documents": len(texts)}, progress=True, **fit_kw)
        path = cal.save(args.out)
    cal = Calibration.load(path)
    secs = cal.stats.get("seconds", {})
    print(f"calibration: {path}")
    print(f"  model {cal.model_id or '?'}, layout {len(cal.layout.layers)} layers x {cal.layout.num_kv_heads} KV heads "
          f"x {cal.layout.head_dim}, ratios {', '.join(f'{r:g}' for r in cal.ratios)}, hash {cal.fingerprint}")
    sens = cal.corpus.get("sensitivity") or {}
    print(f"  weighting: {'sensitivity (' + sens.get('method', '?') + ', per ' + str(sens.get('resolution', '?')) + ')' if cal.weighted else 'none (plain squared error)'}")
    used = sorted({TYPE_NAMES[t] for by_kind in cal.plans.values() for pls in by_kind.values() for pl in pls
                   for _, t, _ in pl.segments if t != DROP})
    print(f"  quantization types in the plans: {', '.join(used) or 'none'}")
    print(f"  built in {secs.get('total', '?')} s; this run {time.perf_counter() - t0:.1f} s")
    return 0


def parse_types(spec: str) -> tuple[int, ...]:
    """``all``, ``paper`` or comma-separated type names -> DP type codes."""
    from .calibration.dp import DEFAULT_TYPES, PAPER_TYPES
    from .quant import DROP, TYPE_CODES

    if spec == "all":
        return DEFAULT_TYPES
    if spec == "paper":
        return PAPER_TYPES
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in TYPE_CODES or TYPE_CODES[n] == DROP]
    if bad or not names:
        raise KVTCError(f"unknown quantization type(s) {', '.join(bad) or spec!r}; use all, paper, or names from "
                        f"{', '.join(n for n, c in TYPE_CODES.items() if c != DROP)}")
    return tuple(dict.fromkeys(TYPE_CODES[n] for n in names))


def _is_default_model(name: str) -> bool:
    from . import assets

    return str(name).lower() in ("default", "smollm2", assets.DEFAULT_MODEL.lower())


# ------------------------------------------------------------------------------------------- compress


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="hub id, local HF directory, or 'default' (SmolLM2)")
    p.add_argument("--calibration", default=DEFAULT_CALIBRATION,
                   help="calibration file, or 'default' (the embedded model's, built on first use)")


def _add_text_args(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--prompt", help="the text")
    g.add_argument("--file", type=Path, help="a UTF-8 text file holding the text")
    p.add_argument("--chat", action="store_true", help="wrap the text as a user turn of the model's chat template")


def add_compress(sub: Any) -> None:
    p = sub.add_parser("compress", help="prefill a prompt or file and write its compressed KV cache (.kvtc)",
                       description="Prefill the text with the model and write its KV cache as a kvtc blob.")
    _add_text_args(p, required=True)
    _add_model_args(p)
    p.add_argument("--ratio", type=float, default=16, help="target compression ratio (default %(default)s)")
    p.add_argument("--identity", action="store_true", help="store the KV uncompressed (no calibration needed)")
    p.add_argument("--max-tokens", type=int, help="keep only the first N tokens of the text")
    p.add_argument("--out", type=Path, required=True, help="the .kvtc file to write")
    p.set_defaults(run=run_compress)


def run_compress(args: argparse.Namespace) -> int:
    import torch

    from .codec import Codec
    from .fileio import write_atomic
    from .integrations.hf import compress_cache, save_blob

    model, tok = _load_model(args.model)
    ids = _encode_text(tok, _read_text(args), args.chat)
    if args.max_tokens:
        ids = ids[:, : args.max_tokens]
    if ids.shape[1] < 2:
        raise KVTCError("the text holds fewer than 2 tokens; give a longer prompt")
    codec = Codec.identity() if args.identity else Codec(_load_calibration(args.calibration, args.model), args.ratio)
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    blob = compress_cache(cache, model, codec)
    t_encode = time.perf_counter() - t0
    # the token ids first: a blob that exists always has its ids beside it
    write_atomic(_tokens_path(args.out), _tokens_record(blob, ids, args.chat))
    save_blob(args.out, blob)
    info = Codec.inspect(blob)
    print(f"wrote {args.out}: {ids.shape[1]} tokens, {_size(info['original_bytes'])} of bf16 KV -> {_size(len(blob))}")
    print(f"  {_ratio_line(info)}; prefill {t_prefill:.2f} s, encode {t_encode:.2f} s")
    return 0


def _tokens_path(blob_path: Path) -> Path:
    return blob_path.with_name(blob_path.name + TOKENS_SUFFIX)


def _tokens_record(blob: bytes, ids: Any, chat: bool) -> bytes:
    rec = {"format": TOKENS_FORMAT, "version": 1, "blob_sha256": hashlib.sha256(blob).hexdigest(),
           "chat": chat, "token_ids": ids.tolist()}
    return json.dumps(rec).encode()


def _read_tokens(blob_path: Path, blob: bytes) -> list[list[int]] | None:
    path = _tokens_path(blob_path)
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
        ok = rec.get("format") == TOKENS_FORMAT and isinstance(rec.get("token_ids"), list)
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise KVTCError(f"{path} is not a kvtc token record; delete it and pass the text with --prompt/--file")
    if rec.get("blob_sha256") != hashlib.sha256(blob).hexdigest():
        raise KVTCError(f"{path} belongs to another version of {blob_path}; pass the text with --prompt/--file")
    return rec["token_ids"]


# ------------------------------------------------------------------------------------------- generate


def add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text, optionally resuming from a compressed cache",
                       description="Greedy generation. With --resume, the KV of the context comes from a .kvtc "
                                   "file instead of a prefill. The context is the token record `kvtc compress` "
                                   "wrote beside the file, or --prompt/--file (whose first tokens the cache "
                                   "holds, as with transformers' past_key_values).")
    _add_text_args(p, required=False)
    _add_model_args(p)
    p.add_argument("--resume", type=Path, help="a .kvtc file written by `kvtc compress`")
    p.add_argument("--append", default="", help="text to add after the context (e.g. the next turn)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--compare", action="store_true", help="also generate from a full prefill and compare")
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from .codec import Codec
    from .integrations.hf import load_blob, restore_cache

    blob = info = recorded = cal = None
    if args.resume is not None:  # refuse a bad file before spending seconds on the model
        blob = load_blob(args.resume)
        recorded = _read_tokens(args.resume, blob)
        info = Codec.inspect(blob)
        cal = None if info["mode"] == "identity" else _load_calibration(args.calibration, args.model)
    elif args.prompt is None and args.file is None:
        raise KVTCError("give --prompt/--file, or --resume FILE")
    model, tok = _load_model(args.model)
    cache = None
    t_restore = 0.0
    if blob is not None:
        t0 = time.perf_counter()
        cache = restore_cache(blob, model, cal)
        t_restore = time.perf_counter() - t0
        if args.prompt is not None or args.file is not None:
            ids = _encode_text(tok, _read_text(args), args.chat)
        elif recorded is not None:
            ids = torch.tensor(recorded, dtype=torch.int64)
        else:
            raise KVTCError(f"{args.resume} has no token record beside it; pass the text it was made from with --prompt/--file")
        held = cache.get_seq_length()
        if ids.shape[0] != info["batch"] or ids.shape[1] < held:
            raise KVTCError(f"the cache holds {info['batch']} x {held} tokens but the context is "
                            f"{ids.shape[0]} x {ids.shape[1]}; pass the text the cache was made from")
    else:
        ids = _encode_text(tok, _read_text(args), args.chat)
    if args.append:
        extra = tok(args.append, add_special_tokens=False, return_tensors="pt")["input_ids"]
        ids = torch.cat([ids, extra.expand(ids.shape[0], -1)], dim=1)
    if cache is not None and cache.get_seq_length() >= ids.shape[1]:
        # the context's last token is run again so that it yields the next-token logits
        cache.crop(ids.shape[1] - 1 - cache.get_seq_length())
    new, t_first, t_total = _greedy(model, ids, cache, args.max_new_tokens)
    text = tok.decode(new[0], skip_special_tokens=True)
    print(text)
    where = f"restored in {t_restore:.2f} s, " if args.resume is not None else ""
    print(f"[{where}first token {t_first:.2f} s, {new.shape[1]} tokens in {t_total:.2f} s]", file=sys.stderr)
    if args.compare:
        ref, r_first, _ = _greedy(model, ids, None, args.max_new_tokens)
        same = int((ref[:, : new.shape[1]] == new[:, : ref.shape[1]]).all(dim=0).long().cumprod(0).sum())
        print("--- from a full prefill ---")
        print(tok.decode(ref[0], skip_special_tokens=True))
        print(f"[prefill + first token {r_first:.2f} s; first {same} tokens identical]", file=sys.stderr)
    return 0


def _greedy(model: Any, ids: Any, cache: Any, max_new: int) -> tuple[Any, float, float]:
    """Greedy continuation of ``ids`` (``cache`` holding a prefix of them, or None): new ids and timings."""
    import torch
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=model.config)
    done = cache.get_seq_length()
    step = ids[:, done:]
    out = []
    t0 = time.perf_counter()
    t_first = 0.0
    with torch.inference_mode():
        for i in range(max_new):
            logits = model(step, past_key_values=cache, use_cache=True).logits[:, -1]
            step = logits.argmax(-1, keepdim=True)
            out.append(step)
            if i == 0:
                t_first = time.perf_counter() - t0
            eos = model.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
            if ids.shape[0] == 1 and int(step) in eos:
                break
    return torch.cat(out, dim=1), t_first, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------- inspect


def add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show what a .kvtc file holds (no calibration needed)")
    p.add_argument("file", type=Path)
    p.add_argument("--json", action="store_true", help="print every field as JSON")
    p.set_defaults(run=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from .codec import Codec
    from .errors import FormatError

    try:
        blob = args.file.read_bytes()
    except OSError as e:
        raise FormatError(f"cannot read {args.file}: {e.strerror or e}; check the path") from None
    try:
        info = Codec.inspect(blob)
    except FormatError as e:
        raise FormatError(f"{args.file}: {e}") from None
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    lay = info["layout"]
    print(f"{args.file}: kvtc {info['mode']} blob, {_size(info['bytes'])}")
    print(f"  model {info['model_id'] or '?'}; {len(lay['layers'])} KV layers x {len(lay['heads'])} heads x "
          f"{lay['head_dim']} ({lay['dtype']})")
    print(f"  batch {info['batch']} x {info['tokens']} tokens: {info['sinks']} sinks + {info['middle_tokens']} coded + "
          f"{info['window']} window")
    if info["mode"] == "kvtc":
        print(f"  calibration {info['calibration'][:16]}, target {info['target_ratio']}x, packing {info['packing']}")
    print(f"  {_ratio_line(info)}")
    for s in info["sections"]:
        print(f"    {s['name']:<22} {s['backend']:<6} {_size(s['raw']):>10} -> {_size(s['coded']):>10}")
    return 0


# ------------------------------------------------------------------------------------------- demo


def add_demo(sub: Any) -> None:
    from .demo import add_arguments

    p = sub.add_parser("demo", help="end-to-end demo on the embedded default (offline)",
                       description="Calibrate if needed, prefill a held-out document, compress at several "
                                   "ratios, save, restore, continue; print a table and write a plot.")
    add_arguments(p)
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from .demo import run

    run(args)
    return 0


# ------------------------------------------------------------------------------------------- shared


def _load_model(name: str) -> tuple[Any, Any]:
    from . import assets

    return assets.load_model(name)


def _load_calibration(name: str, model: str) -> Any:
    from .calibration.artifact import Calibration

    if name == DEFAULT_CALIBRATION:
        if not _is_default_model(model):
            raise KVTCError("--calibration is required for a model other than the default; make one with `kvtc calibrate`")
        from .integrations.hf_calibrate import default_calibration

        return Calibration.load(default_calibration(progress=True))
    return Calibration.load(name)


def _read_text(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KVTCError(f"cannot read {args.file}: {getattr(e, 'strerror', None) or e}") from None


def _encode_text(tok: Any, text: str, chat: bool) -> Any:
    import torch

    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return torch.tensor([list(ids)], dtype=torch.int64)
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def _ratio_line(info: dict[str, Any]) -> str:
    codec = info["codec_ratio"]
    part = f"codec ratio {codec:.2f}x over {info['middle_tokens']} coded tokens, " if codec else ""
    return f"{part}whole-cache ratio {info['whole_cache_ratio']:.2f}x (vs bf16)"


# ------------------------------------------------------------------------------------------- parser

#: built-in subcommands, in help order
COMMANDS: dict[str, Callable[[Any], None]] = {
    "calibrate": add_calibrate,
    "compress": add_compress,
    "generate": add_generate,
    "inspect": add_inspect,
    "demo": add_demo,
}
#: modules that add subcommands through ``register(subparsers)`` when they are present
PLUGINS: tuple[str, ...] = ("kvtc.eval.cli", "kvtc.bench.cli")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="kvtc", description="KV cache transform coding (KVTC) for LLM KV caches.")
    parser.add_argument("--version", action="version", version=f"kvtc {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS.values():
        add(sub)
    for module in PLUGINS:
        if _module_present(module):
            importlib.import_module(module).register(sub)
    return parser


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args) or 0)
    except (KVTCError, OSError) as e:
        if debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"kvtc: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("kvtc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
