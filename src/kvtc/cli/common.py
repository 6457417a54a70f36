"""What several subcommands share: the model and calibration options, the text options, sizes and ratios."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, NoReturn

from .. import textsafe
from ..errors import KVTCError

#: the most text a --file may hold
MAX_TEXT_BYTES = 256 << 20


class Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (``kvtc: error: ...``, exit 2), like every other kvtc error."""

    def error(self, message: str) -> NoReturn:
        print(f"kvtc: error: {textsafe.message(message)} (see `{textsafe.message(self.prog)} --help`)", file=sys.stderr)
        raise SystemExit(2)


#: the most tokens a command line may ask for (a million: beyond any model's context)
MAX_TOKENS = 1 << 20


def positive_int(text: str) -> int:
    """An argparse type: a whole number from 1 to :data:`MAX_TOKENS`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
    if not 1 <= value <= MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{text[:40]} must be from 1 to {MAX_TOKENS}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return value


def ratio_value(text: str) -> float:
    """An argparse type: a compression ratio, a finite number above 1."""
    value = positive_float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a compression ratio: give a number above 1 (e.g. 16)")
    return value


def check_out(path: Path | None, what: str) -> None:
    """Refuse an output path whose directory does not exist (nothing is created that was not asked for) or that
    names a directory, before any work is done."""
    if path is None:
        return
    if path.is_dir():
        raise KVTCError(f"{path} is a directory; give the path of the {what} to write")
    if path.exists() and not path.is_file():
        raise KVTCError(f"{path} exists and is not a regular file; give another path for the {what}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise KVTCError(
            f"the directory {parent} does not exist; create it first (kvtc does not create directories for the {what})"
        )


DEFAULT_MODEL = "default"
#: what :func:`kvtc.integrations.hf_calibrate.load_calibration` resolves to the embedded model's calibration
DEFAULT_CALIBRATION = "default"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="hub id, local HF directory, or an embedded model: 'default' (SmolLM2), 'smollm2', 'gemma3'",
    )
    p.add_argument(
        "--calibration",
        default=DEFAULT_CALIBRATION,
        help="calibration file, or 'default' (an embedded model's own, built on first use)",
    )


def add_text_args(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--prompt", help="the text")
    g.add_argument("--file", type=Path, help="a UTF-8 text file holding the text")
    p.add_argument("--chat", action="store_true", help="wrap the text as a user turn of the model's chat template")


def load_model(name: str) -> tuple[Any, Any]:
    from .. import assets

    return assets.load_model(name)


def read_text(args: argparse.Namespace) -> str:
    """The --prompt text or the --file's (a regular UTF-8 file); refuses an empty text."""
    from ..fileio import read_regular

    if args.prompt is not None:
        text, where = args.prompt, "--prompt"
    else:
        try:
            text = read_regular(args.file, "a UTF-8 text file", MAX_TEXT_BYTES).decode("utf-8")
        except UnicodeDecodeError:
            raise KVTCError(f"{args.file} is not UTF-8 text; give a UTF-8 text file") from None
        where = str(args.file)
    if not text.strip():
        raise KVTCError(f"{where} holds no text; give the text to work on")
    return text


def encode_text(tok: Any, text: str, chat: bool) -> Any:
    import torch

    if chat:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
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
