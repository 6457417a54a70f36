"""The decoding allowance: how much a blob may make a decoder allocate, checked before anything is allocated
(docs/FORMAT.md, "Decoding allowance"): first against the codec's own ceiling from the header alone
(:func:`check_declared`), then, once the header is checked against the calibration, from the exact section sizes that
check implies and the blob's own length (:func:`check_allowance`). No header field can raise it."""

from __future__ import annotations

from ..errors import FormatError, LayoutError
from ..textsafe import printable
from .header import _ESIZE, PAD_SECTION, Header

#: default ceiling on the bytes one ``decode`` may produce and stage (the ``max_decoded_bytes`` of a Codec)
DEFAULT_MAX_DECODED_BYTES = 32 << 30
#: what a blob of any size may always declare (a header, a few tokens)
BUDGET_FLOOR_BYTES = 64 << 10
#: the most a blob's sections may shrink in all: their raw bytes over their coded bytes. Real KV's streams shrink
#: 1.1-1.6x (BENCHMARKS, "Decoding allowance"); an encoder adds a ``pad`` section of zeros to a blob whose streams
#: shrink more (an all-zero cache), so that every blob it writes is within this and a decoder can refuse the rest
MAX_CODER_GAIN = 4
#: a decode allocates every layer for every token, zero where a sliding layer holds none: at most this many times
#: the bytes the layers hold (a longer sequence over short windows needs its layers decoded separately)
MAX_HELD_SPARSITY = 64


def decoded_bytes(header: Header) -> int:
    """Bytes a decode of ``header`` allocates for its results and staged streams: the keys and values of
    every token in the layout's dtype, the positions, and every section's decoded stream."""
    return decoded_output_bytes(header) + 8 * header.batch * header.tokens + sum(s.raw for s in header.sections)


def decoded_output_bytes(header: Header) -> int:
    """Bytes of the decoded keys and values: every layer for every token, in the layout's dtype."""
    lay = header.layout
    return 2 * header.batch * header.tokens * lay.num_features * _ESIZE.get(lay.dtype, 4)


def check_sparsity(header: Header) -> int:
    """Refuse a slice whose sliding-window layers hold under 1/:data:`MAX_HELD_SPARSITY` of its tokens (a decode
    allocates every layer for every token). Returns the bytes the layers hold."""
    held = header.held_bytes()
    dense = decoded_output_bytes(header)
    if header.layout.max_tokens and dense > MAX_HELD_SPARSITY * held:
        raise LayoutError(
            f"the sliding-window layers hold under 1/{MAX_HELD_SPARSITY} of the {header.tokens} tokens, and a decode "
            "allocates every layer for every token; encode the newest tokens only (shorter slices)"
        )
    return held


def needs_padding(raw: int, coded: int) -> bool:
    """Whether sections of ``raw`` bytes coded into ``coded`` shrink more than a decoder allows."""
    return raw > BUDGET_FLOOR_BYTES and raw > MAX_CODER_GAIN * coded


def pad_bytes(raw: int, coded: int) -> int:
    """The fewest zero bytes that, stored raw beside sections of ``raw`` bytes coded into ``coded``, bring the
    whole within :data:`MAX_CODER_GAIN` (``raw + n <= MAX_CODER_GAIN * (coded + n)``)."""
    return max(0, -(-(raw - MAX_CODER_GAIN * coded) // (MAX_CODER_GAIN - 1)))


def check_declared(header: Header, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> int:
    """Refuse, from the header alone, a blob that declares more decoding work than this codec takes
    (``max_decoded_bytes``) or sliding-window layers that hold almost none of its tokens. Returns the declared
    decoded bytes. Only a bound the caller set: what the blob may cost for its size is :func:`check_allowance`'s."""
    need = decoded_bytes(header)
    if need > max_decoded_bytes:
        raise FormatError(
            f"blob declares {need} decoded bytes ({header.batch}x{header.tokens} tokens), above this codec's "
            f"max_decoded_bytes={max_decoded_bytes}; raise max_decoded_bytes if the blob is trusted"
        )
    try:
        check_sparsity(header)
    except LayoutError as e:
        raise FormatError(f"{e}; the blob is corrupt or hostile") from None
    return need


def check_allowance(header: Header, expected_raw: dict[str, int]) -> None:
    """Refuse, before any section is read, a blob whose sections are not what its verified settings require or
    that shrink more than any blob kvtc writes. ``expected_raw``: each section's exact raw size, derived from facts
    the decoder checked against the calibration (plans, tier and rung names, layout, token counts), never from a
    header's word. The allowance: the sections' raw bytes (which fix what a decode allocates: every plan's bits per
    token, the raw sinks and window, positions and token ids) at most :data:`MAX_CODER_GAIN` times their coded bytes
    (docs/FORMAT.md, "Decoding allowance")."""
    secs = header.sections
    pad = secs[-1] if secs and secs[-1].name == PAD_SECTION else None
    names = [s.name for s in secs[: -1 if pad else None]]
    if names != list(expected_raw):
        raise FormatError(
            f"blob sections {[printable(n, 64) for n in names[:6]]} do not match what its settings require "
            f"{list(expected_raw)[:6]}; the blob is corrupt"
        )
    for s in secs:
        if s is not pad and expected_raw[s.name] != s.raw:
            raise FormatError(f"section {s.name}: {s.raw} bytes declared, {expected_raw[s.name]} expected")
    raw = sum(expected_raw.values())
    if pad is not None and (
        not needs_padding(raw, sum(s.coded for s in secs) - pad.coded) or pad.raw > pad_bytes(raw, 0)
    ):
        raise FormatError(f"a pad section of {pad.raw} bytes where the blob needs {pad_bytes(raw, 0)} at most; corrupt")
    raw += 0 if pad is None else pad.raw
    coded = sum(s.coded for s in secs)
    if needs_padding(raw, coded):
        raise FormatError(
            f"blob's sections code {raw} bytes in {coded} ({raw / max(coded, 1):.0f}x; kvtc writes at most "
            f"{MAX_CODER_GAIN}x): it is corrupt or hostile"
        )
