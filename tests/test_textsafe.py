"""kvtc.textsafe: strings from outside (blobs, calibrations, stores) made safe to print or log."""

from __future__ import annotations

import io
import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtc.textsafe import DEFAULT_LIMIT, message, printable, tolerant_streams

HOSTILE = "\x1b[2J\x1b]0;pwned\x07\r\u202e\ud800\x9b31m\u2028\u200b\ufeff\udcff\U000e0001\x00\x7f"


def _safe(out: str) -> None:
    assert out.isprintable(), out
    out.encode("utf-8")  # no lone surrogate
    assert not any(unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") for ch in out)
    assert "\x1b" not in out and "\r" not in out and "\n" not in out


def test_hostile_characters_are_escaped():
    out = printable(HOSTILE)
    _safe(out)
    for escape in ("\\x1b[2J", "\\x07", "\\x0d", "\\u202e", "\\ud800", "\\x9b", "\\u2028", "\\udcff", "\\U000e0001"):
        assert escape in out, escape


def test_printable_text_is_kept_and_backslashes_are_escaped():
    assert printable("Llama-3.1 8B / modèle ü 日本語 🙂") == "Llama-3.1 8B / modèle ü 日本語 🙂"
    # a literal backslash is escaped too, so that "\x1b" as text and an ESC character never look alike
    assert printable("\\x1b") == "\\x5cx1b" != printable("\x1b")
    assert printable("a\\b", backslash=False) == "a\\b"


def test_long_strings_are_cut_with_a_note():
    out = printable("x" * 1000)
    assert out == "x" * DEFAULT_LIMIT + "...(+800 chars)"
    assert printable("\x1b" * 10, 3) == "\\x1b" * 3 + "...(+7 chars)"
    assert printable("abc", None) == "abc" and printable("abc", 0) == "...(+3 chars)"


def test_non_strings_and_broken_objects():
    class Broken:
        def __str__(self):
            raise RuntimeError("no")

    assert printable(12) == "12" and printable(None) == "None"
    assert printable(Broken()) == "<Broken object>"
    assert printable(b"\x1b") == "b'\\x5cx1b'"  # str(bytes) is its repr: its backslash is escaped in turn


def test_message_is_one_line_and_keeps_reprs_readable():
    e = ValueError("section 'a\\x1b': bad\n\tvalue \x1b[2J \ud800")
    out = message(e)
    _safe(out)
    assert out == "section 'a\\x1b': bad value \\x1b[2J \\ud800"
    assert message("x" * 5000).endswith("...(+3000 chars)")


def test_tolerant_streams_never_raise_on_encoding():
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    tolerant_streams(stream)
    stream.write("modèle \ud800\n")
    stream.flush()
    assert raw.getvalue() == b"mod\\xe8le \\ud800\n"
    tolerant_streams(io.StringIO())  # nothing to reconfigure: left as it is


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF)))
def test_any_string_prints_safely(s):
    _safe(printable(s))
    _safe(printable(s, None))
    _safe(message(s))


@settings(max_examples=400, deadline=None)
@given(
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=DEFAULT_LIMIT),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=DEFAULT_LIMIT),
)
def test_distinct_short_strings_stay_distinct(a, b):
    if a != b:
        assert printable(a) != printable(b)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("\\xu0123456789abcdefU\x1b\ud800\u202e "), max_size=40))
def test_escapes_decode_back(s):
    """Injective because the escapes are a prefix code: unicode_escape reads every result back to its input."""
    assert printable(s, None).encode("ascii").decode("unicode_escape") == s
