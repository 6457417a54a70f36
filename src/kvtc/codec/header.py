"""The container's header (docs/FORMAT.md section 1): what a decoder needs to know before touching the sections,
and its validation from the JSON a blob carries (:func:`parse_header`). The framing around it (prefix, CRCs,
sections) is :mod:`kvtc.codec.container`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..coding.packing import PACKINGS
from ..errors import FormatError, LayoutError
from ..layout import MAX_TOKENS, KVLayout, Span
from ..textsafe import printable

#: most plans a rate-ladder blob may name (its rung indices are bytes)
MAX_RUNGS = 16
MAX_GROUPS = 4096
#: absolute caps on what a header may declare (a blob is one slice of one conversation batch)
MAX_BATCH = 1 << 12
MAX_SECTIONS = 4096
MAX_TOTAL_RAW_BYTES = 1 << 36
MAX_KV_HEADS = 1 << 12  # served models have at most a few hundred KV heads
#: the smallest share of a group's middle tokens a two-tier blob may code at either tier
MIN_SHARE = 1e-6
MODES = ("kvtc", "identity")
#: the optional last section an encoder adds to a blob whose streams shrink more than
#: :data:`kvtc.codec.budget.MAX_CODER_GAIN` (zeros, stored raw; docs/FORMAT.md, "Decoding allowance")
PAD_SECTION = "pad"
#: a ratio as kvtc writes it (:func:`kvtc.calibration.ratio_key`): ASCII digits, no sign, space or exponent case
_RATIO = re.compile(r"(0|[1-9][0-9]{0,5})(\.[0-9]{1,6})?(e[+-][0-9]{2})?")
_ESIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class Section:
    name: str
    backend: str
    raw: int
    coded: int
    crc32: int


@dataclass
class Header:
    """Everything a decoder needs to know before touching the sections."""

    mode: str
    calibration: str | None
    model_id: str
    layout: KVLayout
    batch: int
    tokens: int
    sinks: int
    window: int
    ratio: str | None
    packing: str
    sections: list[Section] = field(default_factory=list)
    #: token-adaptive rates: (high target, low target, share of each group's middle tokens at the high one)
    tiers: tuple[str, str, float] | None = None
    #: rate ladder: the plans' ratio keys (rung ``j`` codes its tokens with ``rungs[j]``'s plan) and, per kind and
    #: PCA group, how many middle tokens each rung codes
    rungs: tuple[str, ...] | None = None
    rung_counts: dict[str, list[list[int]]] | None = None
    #: the middle tokens are coded less the calibration's token-map prediction, and section ``tokens`` holds the
    #: token ids it is made from (container version 5)
    predicted: bool = False

    @property
    def version(self) -> int:
        """The container version this header is written as (5 with token ids, else 4 with a rate ladder, 3 with two
        tiers, else 2 only when some layer holds fewer tokens, else 1)."""
        if self.predicted:
            return 5
        return 4 if self.rungs else 3 if self.tiers else 2 if self.layout.max_tokens else 1

    @property
    def adaptive(self) -> bool:
        """Whether the middle tokens are coded by more than one plan (two tiers or a rate ladder)."""
        return bool(self.tiers or self.rungs)

    @property
    def spans(self) -> list[tuple[Span, int, int, int, int]]:
        """``(span, first, sinks, window, middle)`` per :attr:`KVLayout.spans`: the first token those layers hold,
        how many of the held tokens are stored raw as sinks and as the recent window, and how many are coded."""
        out = []
        for sp in self.layout.spans:
            first, s, w = sp.protected(self.tokens, self.sinks, self.window)
            out.append((sp, first, s, w, sp.held(self.tokens) - s - w))
        return out

    @property
    def protected(self) -> tuple[int, int]:
        """(sinks, window) stored raw per sequence by layers that hold every token."""
        s = min(self.sinks, self.tokens)
        w = min(self.window, self.tokens - s)
        return s, w

    @property
    def middle_tokens(self) -> int:
        """The most coded tokens of any layer (0: the blob stores every held token raw)."""
        return max(m for *_, m in self.spans)

    def held_bytes(self) -> int:
        """Bytes of the keys and values the layers hold, in the layout's dtype."""
        lay = self.layout
        held = sum(sp.held(self.tokens) * len(sp.indices) for sp in lay.spans)
        return 2 * self.batch * held * len(lay.heads) * lay.head_dim * _ESIZE.get(lay.dtype, 4)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "calibration": self.calibration,
            "model_id": self.model_id,
            "layout": self.layout.to_dict(),
            "batch": self.batch,
            "tokens": self.tokens,
            "sinks": self.sinks,
            "window": self.window,
            "ratio": self.ratio,
            "packing": self.packing,
            "sections": [[s.name, s.backend, s.raw, s.coded, s.crc32] for s in self.sections],
            **({"tiers": list(self.tiers)} if self.tiers else {}),
            **({"rungs": list(self.rungs), "rung_counts": self.rung_counts} if self.rungs else {}),
            **({"predicted": True} if self.predicted else {}),
        }


def _req(d: dict[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise FormatError(f"container header lacks {key!r}")
    v = d[key]
    if isinstance(v, bool) and typ is not bool or not isinstance(v, typ):
        raise FormatError(f"container header field {key!r} has the wrong type")
    return v


def canonical_ratio(ratio: Any) -> bool:
    """Whether ``ratio`` is a ratio's text as :func:`kvtc.calibration.ratio_key` writes it (``"16"``, ``"2.5"``):
    ASCII, no space, sign, leading zero or full-width digit, positive and at most 1e6, and unchanged when read and
    written again."""
    if not (isinstance(ratio, str) and _RATIO.fullmatch(ratio)):
        return False
    r = float(ratio)
    return 1e-3 <= r <= 1e6 and format(r, "g") == ratio


def parse_header(d: Any) -> Header:
    """A container header from its parsed JSON object, every field checked for type and range and every declared
    size bounded by the token counts and the layout (docs/FORMAT.md); raises :class:`~kvtc.errors.FormatError`."""
    if not isinstance(d, dict):
        raise FormatError("container header must be a JSON object")
    mode = _req(d, "mode", str)
    if mode not in MODES:
        raise FormatError(f"unknown codec mode {mode!r}")
    cal = d.get("calibration")
    if mode == "kvtc" and not (isinstance(cal, str) and 0 < len(cal) <= 128):
        raise FormatError("kvtc blob without a calibration hash")
    if mode == "identity" and cal is not None:
        raise FormatError("identity blob must not name a calibration")
    layout_d = _req(d, "layout", dict)
    nkv = layout_d.get("num_kv_heads")
    if isinstance(nkv, int) and nkv > MAX_KV_HEADS:  # an empty "heads" would make KVLayout build range(nkv)
        raise FormatError("container layout declares too many KV heads")
    try:
        layout = KVLayout.from_dict(layout_d)
    except LayoutError as e:
        raise FormatError(f"container layout invalid: {e}") from None
    batch, tokens = _req(d, "batch", int), _req(d, "tokens", int)
    sinks, window = _req(d, "sinks", int), _req(d, "window", int)
    if not (
        0 <= batch <= MAX_BATCH and 0 <= tokens <= MAX_TOKENS and 0 <= sinks <= MAX_TOKENS and 0 <= window <= MAX_TOKENS
    ):
        raise FormatError("container token counts out of range")
    if layout.num_features > 1 << 24:
        raise FormatError("container layout too large")
    ratio = d.get("ratio")
    if mode == "identity" and ratio is not None:
        raise FormatError("identity blob must not name a ratio; the blob is corrupt")
    if mode == "kvtc" and not canonical_ratio(ratio):
        raise FormatError(
            f"container ratio {printable(ratio, 40)!r} is not a ratio as kvtc writes it; the blob is corrupt"
        )
    packing = _req(d, "packing", str)
    if packing not in PACKINGS:
        raise FormatError(f"unknown packing {packing!r}")
    model_id = _req(d, "model_id", str)
    if len(model_id) > 4096:
        raise FormatError("model id too long")
    secs = _req(d, "sections", list)
    if len(secs) > MAX_SECTIONS:
        raise FormatError("too many sections")
    # largest legitimate section: int64 positions or fp32 tokens, 2 bytes per fp16 param per feature
    bound = 8 * max(batch * tokens, 1) * layout.num_features + 64
    sections, seen, total_raw = [], set(), 0
    for s in secs:
        if not (isinstance(s, list) and len(s) == 5):
            raise FormatError("malformed section entry")
        name, backend, raw, coded, crc = s
        if not (isinstance(name, str) and 0 < len(name) <= 64 and name not in seen):
            raise FormatError("malformed or duplicate section name")
        if not (isinstance(backend, str) and 0 < len(backend) <= 32):
            raise FormatError("malformed section backend")
        for v in (raw, coded, crc):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise FormatError(f"section {name}: sizes and checksum must be non-negative integers")
        if raw > bound or crc > 0xFFFFFFFF:
            raise FormatError(f"section {printable(name, 64)}: declared size out of range for {batch}x{tokens} tokens")
        # an encoder stores a stream that coding does not shrink raw: no backend's stream is longer than its data
        if coded > raw or (backend == "raw") != (coded == raw):
            raise FormatError(
                f"section {printable(name, 64)}: {coded} coded bytes for {raw} raw under backend "
                f"{printable(backend, 32)!r} (a stream that does not shrink is stored raw); the blob is corrupt"
            )
        if name == PAD_SECTION and (backend != "raw" or len(sections) != len(secs) - 1):
            raise FormatError("a pad section must be the last one, stored raw; the blob is corrupt")
        total_raw += raw
        seen.add(name)
        sections.append(Section(name, backend, raw, coded, crc))
    if total_raw > min(2 * bound, MAX_TOTAL_RAW_BYTES):
        raise FormatError("sections declare more bytes than the slice can hold")
    tiers = d.get("tiers")
    if tiers is not None:
        ok = isinstance(tiers, list) and len(tiers) == 3 and mode == "kvtc"
        ok = ok and all(canonical_ratio(t) for t in tiers[:2])
        ok = ok and isinstance(tiers[2], float) and MIN_SHARE <= tiers[2] <= 1.0 - MIN_SHARE
        if not ok:
            raise FormatError("container tiers field invalid; the blob is corrupt")
        tiers = (tiers[0], tiers[1], tiers[2])
    rungs, counts = _parse_ladder(d, mode, batch * tokens)
    if tiers is not None and rungs is not None:
        raise FormatError("container has both tiers and a rate ladder; the blob is corrupt")
    predicted = d.get("predicted", False)
    if predicted is not False and (predicted is not True or mode != "kvtc"):
        raise FormatError("container predicted field invalid; the blob is corrupt")
    header = Header(
        mode, cal, model_id, layout, batch, tokens, sinks, window, ratio, packing, sections, tiers, rungs, counts,
        predicted,
    )  # fmt: skip
    if mode == "identity" and header.middle_tokens:
        raise FormatError("identity blob must store every token raw (sinks + window < tokens); the blob is corrupt")
    if batch == 0 and header.middle_tokens:
        raise FormatError("empty batch with coded middle tokens; the blob is corrupt")
    if predicted and not header.middle_tokens:
        raise FormatError("a blob with token ids but no coded tokens; the blob is corrupt")
    return header


def _parse_ladder(
    d: dict[str, Any], mode: str, max_count: int
) -> tuple[tuple[str, ...] | None, dict[str, list[list[int]]] | None]:
    """The header's ``rungs`` and ``rung_counts``, checked for shape and range (their sums against the layout are
    checked by the codec, which knows the PCA groups)."""
    rungs, counts = d.get("rungs"), d.get("rung_counts")
    if rungs is None and counts is None:
        return None, None
    ok = mode == "kvtc" and isinstance(rungs, list) and 2 <= len(rungs) <= MAX_RUNGS
    ok = ok and all(canonical_ratio(r) for r in rungs) and len(set(rungs)) == len(rungs)
    ok = ok and isinstance(counts, dict) and sorted(counts) == ["keys", "values"]
    if ok:
        for per_group in counts.values():
            ok = ok and isinstance(per_group, list) and 0 < len(per_group) <= MAX_GROUPS
            for c in per_group if ok else ():
                ok = ok and isinstance(c, list) and len(c) == len(rungs)
                ok = ok and all(type(n) is int and 0 <= n <= max_count for n in c)
    if not ok:
        raise FormatError("container rate ladder (rungs, rung_counts) invalid; the blob is corrupt")
    return tuple(rungs), {k: [list(c) for c in v] for k, v in counts.items()}


__all__ = ["MAX_BATCH", "MAX_GROUPS", "MAX_KV_HEADS", "MAX_RUNGS", "MAX_SECTIONS", "MAX_TOTAL_RAW_BYTES", "MODES",
           "PAD_SECTION", "Header", "Section", "canonical_ratio", "parse_header"]  # fmt: skip
