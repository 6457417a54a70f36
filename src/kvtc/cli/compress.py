"""``kvtc compress``: prefill a text and write its compressed KV cache, with its token ids beside it."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from ..errors import KVTCError
from .common import (
    MAX_TOKENS,
    add_model_args,
    add_text_args,
    check_out,
    encode_text,
    load_model,
    positive_int,
    ratio_line,
    ratio_value,
    read_text,
    size,
)

#: suffix of the file ``kvtc compress`` writes beside a blob: the token ids the cache stands for
TOKENS_SUFFIX = ".tokens.json"
#: the largest token record read beside a blob
MAX_TOKENS_BYTES = 256 << 20
TOKENS_FORMAT = "kvtc-tokens"


def add_compress(sub: Any) -> None:
    p = sub.add_parser(
        "compress",
        help="prefill a prompt or file and write its compressed KV cache (.kvtc)",
        description="Prefill the text with the model and write its KV cache as a kvtc blob.",
    )
    add_text_args(p, required=True)
    add_model_args(p)
    p.add_argument("--ratio", type=ratio_value, default=16, help="target compression ratio (default %(default)s)")
    p.add_argument("--identity", action="store_true", help="store the KV uncompressed (no calibration needed)")
    p.add_argument(
        "--tiers",
        choices=("auto", "two", "none"),
        default="auto",
        help="auto: the rate ladder, each token of each kind and layer group coded by the calibration's plan from "
        "ratio/8 to 8x ratio that serves it best for the bytes, weighted by the attention it receives (container "
        "version 4; default, when the calibration records queries); two: two tiers, a share of the tokens at a "
        "finer plan and the rest at a coarser one (version 3); none: one plan for every token",
    )
    p.add_argument("--max-tokens", type=positive_int, help="keep only the first N tokens of the text")
    p.add_argument("--out", type=Path, required=True, help="the .kvtc file to write")
    p.set_defaults(run=run_compress)


def run_compress(args: argparse.Namespace) -> int:
    import torch

    from ..codec import Codec
    from ..fileio import write_atomic
    from ..integrations.hf import compress_cache, save_blob
    from ..integrations.hf_calibrate import load_calibration

    # everything the user gave is checked before the model is loaded
    check_out(args.out, ".kvtc file")
    text = read_text(args)
    cal = None if args.identity else load_calibration(args.calibration, model=args.model)
    codec = Codec.identity() if cal is None else Codec(cal, args.ratio, tiers=args.tiers)
    model, tok = load_model(args.model)
    ids = encode_text(tok, text, args.chat)
    if args.max_tokens:
        ids = ids[:, : args.max_tokens]
    if ids.shape[1] < 2:
        raise KVTCError("the text holds fewer than 2 tokens; give a longer prompt")
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    blob = compress_cache(cache, model, codec, input_ids=ids)
    t_encode = time.perf_counter() - t0
    # the token ids first: a blob that exists always has its ids beside it
    write_atomic(_tokens_path(args.out), _tokens_record(blob, ids, args.chat))
    save_blob(args.out, blob)
    info = Codec.inspect(blob)
    print(f"wrote {args.out}: {ids.shape[1]} tokens, {size(info['original_bytes'])} of bf16 KV -> {size(len(blob))}")
    print(f"  {ratio_line(info)}; prefill {t_prefill:.2f} s, encode {t_encode:.2f} s")
    return 0


def _tokens_path(blob_path: Path) -> Path:
    return blob_path.with_name(blob_path.name + TOKENS_SUFFIX)


def _tokens_record(blob: bytes, ids: Any, chat: bool) -> bytes:
    rec = {
        "format": TOKENS_FORMAT,
        "version": 1,
        "blob_sha256": hashlib.sha256(blob).hexdigest(),
        "chat": chat,
        "token_ids": ids.tolist(),
    }
    return json.dumps(rec).encode()


def read_tokens(blob_path: Path, blob: bytes) -> list[list[int]] | None:
    """The token record `kvtc compress` wrote beside ``blob_path`` (None when there is none): checked to be
    a record of this blob holding a non-empty batch of equal-length rows of token ids."""
    from ..fileio import read_regular

    path = _tokens_path(blob_path)
    if not path.exists():
        return None
    try:
        rec = json.loads(read_regular(path, "a kvtc token record", MAX_TOKENS_BYTES))
        ok = rec.get("format") == TOKENS_FORMAT
        ids = rec.get("token_ids")
    except (ValueError, AttributeError, RecursionError):
        ok, ids = False, None
    if not ok:
        raise KVTCError(f"{path} is not a kvtc token record; delete it and pass the text with --prompt/--file")
    if rec.get("blob_sha256") != hashlib.sha256(blob).hexdigest():
        raise KVTCError(f"{path} belongs to another version of {blob_path}; pass the text with --prompt/--file")
    if not (
        isinstance(ids, list)
        and ids
        and all(isinstance(row, list) and row for row in ids)
        and len({len(row) for row in ids}) == 1
        and len(ids) * len(ids[0]) <= MAX_TOKENS
        and all(type(t) is int and 0 <= t < 1 << 31 for row in ids for t in row)
    ):
        raise KVTCError(
            f"{path}: token_ids must be a batch of equal-length, non-empty rows of at most {MAX_TOKENS} token "
            "ids in all; delete it "
            "and pass the text with --prompt/--file"
        )
    return ids
