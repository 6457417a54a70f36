"""What several subcommands share: the model and calibration options, the text options, sizes and ratios."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import KVTCError

DEFAULT_MODEL = "default"
#: what :func:`kvtc.calibration.load_calibration` resolves to the embedded model's calibration
DEFAULT_CALIBRATION = "default"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="hub id, local HF directory, or 'default' (SmolLM2)")
    p.add_argument("--calibration", default=DEFAULT_CALIBRATION,
                   help="calibration file, or 'default' (the embedded model's, built on first use)")


def add_text_args(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--prompt", help="the text")
    g.add_argument("--file", type=Path, help="a UTF-8 text file holding the text")
    p.add_argument("--chat", action="store_true", help="wrap the text as a user turn of the model's chat template")


def load_model(name: str) -> tuple[Any, Any]:
    from .. import assets

    return assets.load_model(name)


def read_text(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KVTCError(f"cannot read {args.file}: {getattr(e, 'strerror', None) or e}") from None


def encode_text(tok: Any, text: str, chat: bool) -> Any:
    import torch

    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return torch.tensor([list(ids)], dtype=torch.int64)
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def ratio_line(info: dict[str, Any]) -> str:
    codec = info["codec_ratio"]
    part = f"codec ratio {codec:.2f}x over {info['middle_tokens']} coded tokens, " if codec else ""
    return f"{part}whole-cache ratio {info['whole_cache_ratio']:.2f}x (vs bf16)"
