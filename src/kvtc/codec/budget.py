"""The decoding budget: how much a blob may make a decoder allocate, checked from its header before anything is
allocated (docs/FORMAT.md, "Validation", step 3)."""

from __future__ import annotations

from ..errors import FormatError, LayoutError
from .header import _ESIZE, Header

#: default ceiling on the bytes one ``decode`` may produce and stage (the ``max_decoded_bytes`` of a Codec)
DEFAULT_MAX_DECODED_BYTES = 32 << 30
#: what a blob of any size may always declare (a header, a few tokens)
BUDGET_FLOOR_BYTES = 64 << 10
#: identity blobs store KV as it is: an entropy coder shrinks real KV by well under 2x
IDENTITY_EXPANSION = 64
#: kvtc blobs: decoded bytes per stored byte may reach the plan's ratio times the entropy coder's gain
#: (measured 1.2x with zstd; under the Gaussians of the fixed-step planes, kvtc.codec.gaussian, a plane of
#: near-certain symbols costs a small fraction of a bit each: 1.5x on a synthetic plan of int2f groups) and the raw
#: sections; this many times the ratio is refused as no honest blob
KVTC_EXPANSION_PER_RATIO = 8
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


def check_budget(header: Header, blob_len: int, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> int:
    """Refuse, before anything is allocated, a blob that declares more decoding work than it can honestly
    hold: more than ``max_decoded_bytes`` in all, or more decoded bytes per stored byte than its mode allows
    (identity: :data:`IDENTITY_EXPANSION`; kvtc: :data:`KVTC_EXPANSION_PER_RATIO` times its ratio). Returns
    the declared decoded bytes."""
    need = decoded_bytes(header)
    if need > max_decoded_bytes:
        raise FormatError(
            f"blob declares {need} decoded bytes ({header.batch}x{header.tokens} tokens), above this codec's "
            f"max_decoded_bytes={max_decoded_bytes}; raise max_decoded_bytes if the blob is trusted"
        )
    try:
        held = check_sparsity(header)
    except LayoutError as e:
        raise FormatError(f"{e}; the blob is corrupt or hostile") from None
    # what the blob honestly encodes: the tokens its layers hold (the rest of the output is zeros)
    need = held + (need - decoded_output_bytes(header))
    if header.mode == "kvtc":
        try:
            ratio = float(header.ratio or "")
        except ValueError:
            raise FormatError(f"blob names ratio {header.ratio!r}, not a number; the blob is corrupt") from None
        if not 0 < ratio < 1e6:
            raise FormatError(f"blob names ratio {header.ratio!r}, out of range; the blob is corrupt")
        expansion = KVTC_EXPANSION_PER_RATIO * ratio + IDENTITY_EXPANSION
    else:
        expansion = IDENTITY_EXPANSION
    if need > max(expansion * blob_len, BUDGET_FLOOR_BYTES):
        raise FormatError(
            f"blob of {blob_len} bytes declares {need} decoded bytes ({need / max(blob_len, 1):.0f}x, at most "
            f"{expansion:.0f}x for a {header.mode} blob{'' if header.ratio is None else ' at ratio ' + header.ratio}); "
            "it is corrupt or hostile"
        )
    return need
