"""Strings that come from outside (a blob's header, a calibration's metadata, a store's keys and replies) made safe
to print or log: :func:`printable` escapes every character a terminal could act on.

Such a string may hold control characters (``\\x1b[2J``, a carriage return that rewrites the line), Unicode
format and bidirectional controls (U+202E), unassigned or private-use code points, and lone surrogates (which a
UTF-8 terminal cannot even encode: ``print`` raises ``UnicodeEncodeError``). :func:`printable` keeps printable
characters as they are and writes every other one as a Python-style escape (``\\x1b``, ``\\u202e``, ``\\ud800``),
so the result is always printable, encodable as UTF-8 and unambiguous; a long string is cut with a note of how
many characters were left out.

:func:`tolerant_streams` is the last resort for everything else a command prints (a path, generated text): a
character the stream's encoding cannot hold is written as a backslash escape instead of raising.
"""

from __future__ import annotations

import sys
from typing import Any

#: characters kept of one string by default (the rest is summarised)
DEFAULT_LIMIT = 200


def _escape(ch: str) -> str:
    o = ord(ch)
    if o < 0x100:
        return f"\\x{o:02x}"
    if o < 0x10000:
        return f"\\u{o:04x}"
    return f"\\U{o:08x}"


def _keep(ch: str, backslash: bool) -> bool:
    # str.isprintable is False for every control (Cc), format (Cf: U+202E, U+200B...), surrogate (Cs), private-use
    # (Co), unassigned (Cn) and separator (Zl, Zp, Zs but the ASCII space) character
    return ch.isprintable() and not (backslash and ch == "\\")


def printable(value: Any, limit: int | None = DEFAULT_LIMIT, *, backslash: bool = True) -> str:
    """``value`` (any object; a non-string is shown by its ``str``) with every character that is not printable,
    every lone surrogate and every backslash escaped; at most ``limit`` characters of it (None: all), the rest
    summarised as ``...(+N chars)``.

    The result is printable (``str.isprintable``), encodes as UTF-8 and holds no control character; two distinct
    strings of at most ``limit`` characters give distinct results. ``backslash=False`` keeps backslashes as they
    are, for text that already holds escapes (an error message quoting a ``repr``): still safe, no longer
    unambiguous."""
    if isinstance(value, str):
        s = value
    else:
        try:
            s = str(value)
        except Exception:  # noqa: BLE001 - an object whose __str__ fails is still shown
            s = f"<{type(value).__name__} object>"
    cut = 0
    if limit is not None and len(s) > max(limit, 0):
        s, cut = s[: max(limit, 0)], len(s) - max(limit, 0)
    out = "".join(ch if _keep(ch, backslash) else _escape(ch) for ch in s)
    return out + (f"...(+{cut} chars)" if cut else "")


def message(value: Any, limit: int | None = 2000) -> str:
    """An error or log message (``str(value)``) on one printable line: runs of whitespace become one space,
    everything else :func:`printable` escapes is escaped, backslashes are kept (a message may quote a ``repr``)."""
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # noqa: BLE001
        text = f"<{type(value).__name__} object>"
    return printable(" ".join(text.split()), limit, backslash=False)


def tolerant_streams(*streams: Any) -> None:
    """Make text ``streams`` (default: ``sys.stdout`` and ``sys.stderr``) write a character their encoding cannot
    hold (a lone surrogate anywhere, anything beyond ASCII on an ASCII terminal) as a backslash escape instead of
    raising ``UnicodeEncodeError``. Streams that cannot be reconfigured are left as they are."""
    for stream in streams or (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) in ("strict", "surrogateescape") and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (AttributeError, ValueError, OSError, TypeError):
                pass


__all__ = ["DEFAULT_LIMIT", "message", "printable", "tolerant_streams"]
