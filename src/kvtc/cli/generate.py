"""``kvtc generate``: greedy generation, optionally resuming from a compressed cache."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import KVTCError
from .common import add_model_args, add_text_args, encode_text, load_model, positive_int, read_text
from .compress import read_tokens


def add_generate(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text, optionally resuming from a compressed cache",
        description="Greedy generation. With --resume, the KV of the context comes from a .kvtc "
        "file instead of a prefill. The context is the token record `kvtc compress` "
        "wrote beside the file, or --prompt/--file (whose first tokens the cache "
        "holds, as with transformers' past_key_values).",
    )
    add_text_args(p, required=False)
    add_model_args(p)
    p.add_argument("--resume", type=Path, help="a .kvtc file written by `kvtc compress`")
    p.add_argument("--append", default="", help="text to add after the context (e.g. the next turn)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--compare", action="store_true", help="also generate from a full prefill and compare")
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from ..codec import Codec
    from ..integrations.hf import load_blob, restore_cache
    from ..integrations.hf_calibrate import load_calibration

    blob = info = recorded = cal = None
    if args.resume is not None:  # refuse a bad file before spending seconds on the model
        blob = load_blob(args.resume)
        recorded = read_tokens(args.resume, blob)
        info = Codec.inspect(blob)
        cal = None if info["mode"] == "identity" else load_calibration(args.calibration, model=args.model)
    elif args.prompt is None and args.file is None:
        raise KVTCError("give --prompt/--file, or --resume FILE")
    text = read_text(args) if args.prompt is not None or args.file is not None else None
    if recorded is not None and text is None and len(recorded[0]) < info["tokens"]:
        raise KVTCError(
            f"the token record beside {args.resume} holds {len(recorded[0])} tokens, fewer than the "
            f"{info['tokens']} the cache holds; pass the text with --prompt/--file"
        )
    if recorded is not None and text is None and len(recorded) != info["batch"]:
        raise KVTCError(
            f"the token record beside {args.resume} holds {len(recorded)} rows for a batch of "
            f"{info['batch']}; pass the text with --prompt/--file"
        )
    model, tok = load_model(args.model)
    cache = None
    t_restore = 0.0
    if blob is not None:
        t0 = time.perf_counter()
        cache = restore_cache(blob, model, cal)
        t_restore = time.perf_counter() - t0
        if text is not None:
            ids = encode_text(tok, text, args.chat)
        elif recorded is not None:
            ids = torch.tensor(recorded, dtype=torch.int64)
            if int(ids.max()) >= len(tok):
                raise KVTCError(
                    f"the token record beside {args.resume} holds ids beyond the vocabulary of "
                    f"{len(tok)}; it was made with another model"
                )
        else:
            raise KVTCError(
                f"{args.resume} has no token record beside it; pass the text it was made from with --prompt/--file"
            )
        held = cache.get_seq_length()
        if ids.shape[0] != info["batch"] or ids.shape[1] < held:
            raise KVTCError(
                f"the cache holds {info['batch']} x {held} tokens but the context is "
                f"{ids.shape[0]} x {ids.shape[1]}; pass the text the cache was made from"
            )
    else:
        ids = encode_text(tok, text, args.chat)
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
