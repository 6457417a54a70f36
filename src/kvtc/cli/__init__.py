"""``kvtc`` command line: calibrate, compress, generate, inspect, demo (and eval / bench where installed).

Each subcommand is one ``add_<name>(subparsers)`` function, in a module of its own, that registers its parser and
sets ``run`` to a handler ``(args) -> exit code``. :data:`COMMANDS` lists the built-in ones; :data:`PLUGINS` names
modules that register more with a ``register(subparsers)`` function and are imported only when present. Errors
kvtc raises on purpose (and OS errors) print as one line ``kvtc: error: <message>`` with exit code 2; ``--debug``
shows the traceback instead. Nothing heavy (torch, transformers) is imported before a subcommand runs.

An error message may quote a blob, a calibration or a store (a model id, a section name): it is printed escaped
(:func:`kvtc.textsafe.message`), and stdout and stderr write what their encoding cannot hold as backslash escapes
instead of raising (:func:`kvtc.textsafe.tolerant_streams`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import KVTCError
from ..textsafe import message, tolerant_streams
from .calibrate import add_calibrate, parse_types, recipe_from_args
from .common import Parser
from .compress import add_compress
from .generate import add_generate
from .inspect_blob import add_inspect

#: exit code of a failed command (argparse uses the same for usage errors)
EXIT_ERROR = 2


def add_demo(sub: Any) -> None:
    from ..demo import add_arguments

    p = sub.add_parser(
        "demo",
        help="end-to-end demo on the embedded default (offline)",
        description="Calibrate if needed, prefill a held-out document, compress at several "
        "ratios, save, restore, continue; print a table and write a plot.",
    )
    add_arguments(p)
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from ..demo import run

    run(args)
    return 0


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
    from .. import __version__

    parser = Parser(prog="kvtc", description="KV cache transform coding (KVTC) for LLM KV caches.")
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
    tolerant_streams()
    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args) or 0)
    except (KVTCError, OSError) as e:
        if debug:
            raise
        print(f"kvtc: error: {message(e) or type(e).__name__}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("kvtc: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        if debug:
            raise
        print("kvtc: error: out of memory; give a smaller input", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # a bug: still one line, and the way to the traceback
        if debug:
            raise
        print(
            f"kvtc: internal error: {type(e).__name__}: {message(e, 300)} (rerun with --debug for the traceback and "
            "report it)",
            file=sys.stderr,
        )
        return EXIT_ERROR


__all__ = ["COMMANDS", "EXIT_ERROR", "PLUGINS", "build_parser", "main", "parse_types", "recipe_from_args"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
