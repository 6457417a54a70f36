"""Strict validation of a calibration file's metadata, before anything is built from it.

A calibration may come from anywhere (a shared drive, a peer, a download), and its JSON metadata is read before
the file's content hash can be checked. :func:`validate_meta` checks every field's type and range in time
linear in the metadata's size and allocates nothing proportional to the sizes it declares, so a hostile file
(deep nesting, wrong types, NaN or huge numbers, a million declared layers) is a :class:`CalibrationError`
rather than a ``RecursionError``, ``MemoryError`` or a long stall. Free-form fields (``corpus``, ``stats``) may
hold any JSON of bounded depth.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

from ..errors import CalibrationError
from ..layout import DTYPES, MAX_TOKENS, PCAGrouping
from ..quant import TYPE_NAMES
from ..textsafe import printable
from .plan import MAX_STEP, MIN_STEP

#: what a calibration may declare (the largest served models are far below these)
MAX_LAYERS = 1 << 12
MAX_KV_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 13
MAX_FEATURES = 1 << 24
MAX_RATIOS = 1 << 10
MAX_TEXT = 1 << 12
MAX_DEPTH = 32
MAX_SEGMENTS = 1 << 20
#: JSON values (counted by their separators before parsing: parsing is the costly step) in the metadata; the
#: default calibration of a 30-layer model holds a few thousand, a per-layer one of a 126-layer model ~0.7 M
MAX_VALUES = 1 << 20
#: the end of every refusal of a file that no calibrate run writes
_HOSTILE = "the file is corrupt or hostile; recreate it with `kvtc calibrate`"

_TOP = {
    "format",
    "version",
    "library_version",
    "layout",
    "grouping",
    "rope",
    "model_id",
    "corpus",
    "stats",
    "checksum",
    "pca",
    "plans",
    "hash",
    "queries",
    "token_map",
}
_KINDS = ("keys", "values")
FORMAT_NAME = "kvtc-calibration"
#: bound on the JSON metadata we are willing to parse
MAX_META_BYTES = 64 << 20
#: nesting of the metadata's JSON as a whole (its own structure is 7 levels deep; ``corpus``, ``stats`` and
#: ``rope`` are further held to :data:`MAX_DEPTH`), checked on the text before it is parsed
MAX_JSON_DEPTH = MAX_DEPTH + 8
#: digits in a row of one JSON number: a safetensors offset or a sample count is below 2**64 (20 digits), a float
#: written by ``json.dumps`` has at most 17; a longer one is refused before Python builds it
MAX_INT_DIGITS = 24
#: the safetensors header of a calibration file: its JSON (the tensor table and the metadata), its tensors and
#: its metadata entries (a kvtc calibration writes one, ``kvtc``; another writer may add a few short ones)
MAX_HEADER_BYTES = MAX_META_BYTES + (16 << 20)
MAX_TENSORS = 1 << 17
MAX_META_ENTRIES = 64


#: The calibration file format version kvtc writes and reads: 11 (version 10 stored the token map as float16 and the
#: key-to-query map as float32; 11 stores both maps' weights as int8). Its content is told by the file, not the version: the plans' quantization types,
#: feature scales (``scaled``), ``queries`` (with ``map`` or not) and ``token_map``. Older files (versions 1-10) are
#: refused: rebuild.
FORMAT_VERSION = 11


def parse_json(raw: Any, source: Any, limit: int = MAX_META_BYTES) -> Any:
    """``json.loads`` of untrusted text (a ``str`` or bytes of at most ``limit`` bytes), bounded before anything is
    built: the text's type and size, its count of values (:data:`MAX_VALUES`), and, by one vectorised scan of the
    text (:func:`scan_json`), its nesting (:data:`MAX_JSON_DEPTH`) and the length of every number
    (:data:`MAX_INT_DIGITS` digits in a row: no huge ``int`` is ever built, no long float parsed); NaN and Infinity
    are refused. Anything wrong is a :class:`CalibrationError`."""
    if isinstance(raw, str):
        if len(raw) > limit:  # characters: each is at least one byte of the file
            raise CalibrationError(f"{source}: calibration metadata larger than {limit} bytes; the file is corrupt")
        try:
            data = raw.encode("utf-8")  # for the scan only: parsed is the string itself
        except UnicodeEncodeError:
            raise CalibrationError(f"{source}: calibration metadata is not valid UTF-8; the file is corrupt") from None
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        data = bytes(raw)  # bytes the caller already holds (no copy of exact bytes)
    else:
        raise CalibrationError(
            f"{source}: calibration metadata must be a JSON string, got {type(raw).__name__}; the file is corrupt"
        )
    if len(data) > limit:
        raise CalibrationError(f"{source}: calibration metadata larger than {limit} bytes; the file is corrupt")
    values = data.count(b",") + data.count(b":")
    if values > MAX_VALUES:
        raise CalibrationError(
            f"{source}: calibration metadata holds about {values} values, more than the "
            f"{MAX_VALUES} any calibration needs; {_HOSTILE}"
        )
    # the scan's two parts run only where they could find something: past MAX_JSON_DEPTH brackets, and where some
    # run of digits (in a string or not) is longer than MAX_INT_DIGITS
    nest = data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH
    runs = _LONG_RUN in data.translate(_DIGITS)
    shape = scan_json(data, nest, runs) if nest or runs else (0, 0)
    if shape is None or shape[0] > MAX_JSON_DEPTH:
        raise CalibrationError(
            f"{source}: calibration metadata is unbalanced or nested more than {MAX_JSON_DEPTH} levels deep; {_HOSTILE}"
        )
    if shape[1] > MAX_INT_DIGITS:
        raise CalibrationError(
            f"{source}: calibration metadata holds a number of {shape[1]} digits, more than the {MAX_INT_DIGITS} "
            f"any calibration writes; {_HOSTILE}"
        )
    try:
        text = raw if isinstance(raw, str) else data.decode("utf-8")
        del data
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise CalibrationError(
            f"{source}: calibration metadata is not valid JSON ({printable(e, 80)}); recreate the file"
        ) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a calibration may hold")


#: bytes of JSON text per vectorised step of :func:`scan_json`
SCAN_CHUNK = 1 << 18
_QUOTE, _BACKSLASH = b'"', b"\\"
#: :func:`scan_json`'s classes of a byte: 0 other, 1 digit, 2 quote, 3 opening and 4 closing bracket
_TABLE = bytearray(256)
_TABLE[0x30:0x3A] = b"\x01" * 10
_TABLE[0x22], _TABLE[0x5B], _TABLE[0x7B], _TABLE[0x5D], _TABLE[0x7D] = 2, 3, 3, 4, 4
_CLASSES = bytes(_TABLE)
#: every digit to 1, every other byte to 0; a run of digits longer than MAX_INT_DIGITS in that
_DIGITS = bytes(1 if 0x30 <= b <= 0x39 else 0 for b in range(256))
_LONG_RUN = b"\x01" * (MAX_INT_DIGITS + 1)


def scan_json(data: bytes, nest: bool = True, runs: bool = True) -> tuple[int, int] | None:
    """``(deepest nesting of [ and {, longest run of digits)`` outside the strings of JSON text ``data``, or None
    when a bracket closes what is not open. Vectorised (numpy, in chunks of :data:`SCAN_CHUNK`): a few passes over
    the text, the rest on the positions of its quotes, brackets and digit runs. Escaped backslashes and quotes
    are removed first (from each chunk: none ends in a backslash), so that every quote left opens or closes a
    string (in valid JSON; invalid JSON is refused by ``json.loads`` after this scan): a position lies in a string
    when an odd number of quotes precede it. ``nest`` / ``runs`` False: that part is skipped (and reads 0)."""
    import numpy as np

    quotes_before = depth = deepest = run = longest = 0
    pos = 0
    while pos < len(data):
        end = min(pos + SCAN_CHUNK, len(data))
        while end < len(data) and data[end - 1] == 0x5C:  # no escape is cut in two
            end += 1
        piece = data[pos:end]
        pos = end
        if _BACKSLASH in piece:
            piece = piece.replace(_BACKSLASH + _BACKSLASH, b"").replace(_BACKSLASH + _QUOTE, b"")
            if not piece:
                continue
        cls = np.frombuffer(piece.translate(_CLASSES), dtype=np.uint8)
        quotes = np.flatnonzero(cls == 2)
        before, quotes_before = quotes_before, quotes_before + quotes.size
        if nest:
            brackets = np.flatnonzero(cls >= 3)
            brackets = brackets[(np.searchsorted(quotes, brackets) + before) % 2 == 0]  # outside strings
            if brackets.size:
                level = np.cumsum(np.where(cls[brackets] == 3, 1, -1)) + depth
                if int(level.min()) < 0:
                    return None
                deepest, depth = max(deepest, int(level.max())), int(level[-1])
        if runs:
            # runs of digits: the segments between the positions where digit-ness changes, outside strings
            digit = (cls == 1).view(np.int8)
            starts = np.concatenate(([0], np.flatnonzero(digit[1:] != digit[:-1]) + 1))
            lengths = np.diff(np.concatenate((starts, [cls.size])))
            lengths[0] += run if digit[0] else 0  # a run carried over from the previous chunk
            counted = (digit[starts] == 1) & ((np.searchsorted(quotes, starts) + before) % 2 == 0)
            if counted.any():
                longest = max(longest, int(lengths[counted].max()))
            run = int(lengths[-1]) if counted[-1] else 0
    return deepest, longest


def validate_meta(meta: Any, source: Any) -> None:
    """Raise :class:`CalibrationError` (naming the field) unless ``meta`` is well-formed calibration metadata."""
    where = f"{source}: calibration metadata"
    if not isinstance(meta, dict):
        raise CalibrationError(f"{where} must be a JSON object; the file is corrupt")
    extra = set(meta) - _TOP
    if extra:
        raise CalibrationError(
            f"{where} has unknown fields {sorted(extra)[:4]}; the file is corrupt or from a newer kvtc"
        )
    version = _int(meta.get("version"), f"{where} 'version'", 0, 1 << 16)
    if version != FORMAT_VERSION:
        newer = "upgrade kvtc or " if version > FORMAT_VERSION else "files of versions 1-10 are refused: "
        raise CalibrationError(
            f"{source}: a calibration file of format version {version}; this kvtc reads version {FORMAT_VERSION} "
            f"only ({newer}rebuild it with `kvtc calibrate --model ... --out FILE`, or delete the cached file of an "
            "embedded default: it is rebuilt on first use)"
        )
    for name in ("library_version", "model_id"):
        if name in meta:
            _text(meta[name], f"{where} '{name}'")
    for name in ("hash", "checksum"):
        if name in meta and not (isinstance(meta[name], str) and len(meta[name]) == 64):
            raise CalibrationError(f"{where} '{name}' must be a 64-digit hex string; the file is corrupt")
    for name in ("corpus", "stats"):
        if not isinstance(meta.get(name, {}), dict):
            raise CalibrationError(f"{where} '{name}' must be an object; the file is corrupt")
        _bounded_depth(meta.get(name, {}), f"{where} '{name}'")
    if meta.get("rope") is not None:
        if not isinstance(meta["rope"], dict):
            raise CalibrationError(f"{where} 'rope' must be an object or null; the file is corrupt")
        _bounded_depth(meta["rope"], f"{where} 'rope'")
    limits, heads, head_dim = _layout(meta.get("layout"), f"{where} 'layout'")
    groups, width = _groups(meta.get("grouping"), limits, heads, head_dim, f"{where} 'grouping'")
    if 8 * groups + 8 > MAX_TENSORS:
        raise CalibrationError(
            f"{where} 'grouping' implies {groups} PCA groups, more than a file of {MAX_TENSORS} tensors holds; "
            f"{_HOSTILE}"
        )
    _pca(meta.get("pca"), groups, f"{where} 'pca'")
    _plans(meta.get("plans"), groups, width, f"{where} 'plans'")
    if meta.get("token_map") is not None:
        tm = meta["token_map"]
        if not isinstance(tm, dict) or set(tm) != {"lags", "vocab", "gain"} or not isinstance(tm["gain"], dict):
            raise CalibrationError(f"{where} 'token_map' must hold lags, vocab and gain; the file is corrupt")
        _int(tm["lags"], f"{where} 'token_map' 'lags'", 1, 16)
        _int(tm["vocab"], f"{where} 'token_map' 'vocab'", 1, 1 << 24)
        if len(tm["gain"]) > 8:
            raise CalibrationError(f"{where} 'token_map' 'gain' has too many entries; the file is corrupt")
        for name, v in tm["gain"].items():
            _number(v, f"{where} 'token_map' gain {_show(name)}")
    if meta.get("queries") is not None:
        q = meta["queries"]
        if not isinstance(q, dict) or set(q) - {"map"} != {"per_kv_head"} or q.get("map", True) is not True:
            raise CalibrationError(f"{where} 'queries' is malformed; the file is corrupt")
        _int(q["per_kv_head"], f"{where} 'queries' 'per_kv_head'", 1, 1 << 10)


def _int(x: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise CalibrationError(f"{what} must be an integer in [{lo}, {hi}], got {_show(x)}; the file is corrupt")
    return x


def _number(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or (isinstance(x, int) and abs(x) > 1 << 62):
        raise CalibrationError(f"{what} must be a number, got {_show(x)}; the file is corrupt")
    if not math.isfinite(x):
        raise CalibrationError(f"{what} must be finite, got {x}; the file is corrupt")
    return float(x)


def _text(x: Any, what: str) -> str:
    if not isinstance(x, str) or len(x) > MAX_TEXT:
        raise CalibrationError(f"{what} must be a string of at most {MAX_TEXT} characters; the file is corrupt")
    return x


def _list(x: Any, what: str, most: int) -> list[Any]:
    if not isinstance(x, list) or len(x) > most:
        raise CalibrationError(f"{what} must be a list of at most {most} entries, got {_show(x)}; the file is corrupt")
    return x


def _show(x: Any) -> str:
    if isinstance(x, (list, dict)):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, str):
        return repr(x[:40])  # repr escapes every character a terminal could act on
    text = repr(x) if not isinstance(x, int) or abs(x) < 1 << 64 else "a huge integer"
    return text[:40]


def _bounded_depth(x: Any, what: str) -> None:
    """Walk a free-form JSON value iteratively; refuse nesting deeper than :data:`MAX_DEPTH`."""
    stack = [(x, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CalibrationError(f"{what} is nested more than {MAX_DEPTH} levels deep; the file is corrupt")
        if isinstance(v, dict):
            stack.extend((w, depth + 1) for w in v.values())
        elif isinstance(v, list):
            stack.extend((w, depth + 1) for w in v)
        elif isinstance(v, float) and not math.isfinite(v):
            raise CalibrationError(f"{what} holds a number that overflows a float; the file is corrupt")


def _layout(d: Any, what: str) -> tuple[list[int], int, int]:
    """Validates a layout description; returns each layer's ``max_tokens`` (0: every token), heads, head_dim."""
    fields = {"layers", "num_kv_heads", "head_dim", "heads", "dtype"}
    if not isinstance(d, dict) or not fields <= set(d) or not set(d) <= fields | {"max_tokens"}:
        raise CalibrationError(
            f"{what} must be an object with layers, num_kv_heads, head_dim, heads and dtype (and max_tokens)"
        )
    layers = _list(d["layers"], f"{what} 'layers'", MAX_LAYERS)
    prev = -1
    for i in layers:
        prev = _int(i, f"{what} 'layers' entries (ascending)", prev + 1, 1 << 20)
    nkv = _int(d["num_kv_heads"], f"{what} 'num_kv_heads'", 1, MAX_KV_HEADS)
    head_dim = _int(d["head_dim"], f"{what} 'head_dim'", 1, MAX_HEAD_DIM)
    heads = _list(d["heads"], f"{what} 'heads'", nkv)
    prev = -1
    for h in heads:
        prev = _int(h, f"{what} 'heads' entries (ascending, below num_kv_heads)", prev + 1, nkv - 1)
    if not isinstance(d["dtype"], str) or d["dtype"] not in DTYPES:
        raise CalibrationError(f"{what} 'dtype' must be one of {sorted(DTYPES)}, got {_show(d['dtype'])}")
    if not layers or not heads or len(layers) * len(heads) * head_dim > MAX_FEATURES:
        raise CalibrationError(
            f"{what} declares {len(layers)} layers x {len(heads)} heads x {head_dim}: "
            f"none, or more than {MAX_FEATURES} features; the file is corrupt"
        )
    limits = [0] * len(layers)
    if "max_tokens" in d:
        limits = _list(d["max_tokens"], f"{what} 'max_tokens'", len(layers))
        if len(limits) != len(layers):
            raise CalibrationError(f"{what} 'max_tokens' needs one entry per layer; the file is corrupt")
        for x in limits:
            _int(x, f"{what} 'max_tokens' entries", 0, MAX_TOKENS)
    return limits, len(heads), head_dim


def _groups(d: Any, limits: list[int], heads: int, head_dim: int, what: str) -> tuple[int, int]:
    """The number of PCA groups the grouping implies and the widest group's feature count
    (:meth:`~kvtc.layout.PCAGrouping.groups`, counted without building them: no group mixes layers of different
    ``max_tokens``)."""
    if not isinstance(d, dict) or not set(d) <= {"kind", "size"}:
        raise CalibrationError(f"{what} must be an object with kind and size")
    kind = d.get("kind", "global")
    if not isinstance(kind, str) or kind not in PCAGrouping.KINDS:
        raise CalibrationError(f"{what} 'kind' must be one of {PCAGrouping.KINDS}, got {_show(kind)}")
    size = _int(d.get("size", 1), f"{what} 'size'", 1, MAX_LAYERS * MAX_KV_HEADS)
    per_span = Counter(limits)
    if kind == "global":
        return len(per_span), max(per_span.values()) * heads * head_dim
    if kind == "layers":
        groups, widest, run = 0, 0, 0
        for i, limit in enumerate(limits):
            if run and (run == size or limits[i - 1] != limit):
                groups, widest, run = groups + 1, max(widest, run), 0
            run += 1
        return groups + 1, max(widest, run) * heads * head_dim
    if heads % size:
        raise CalibrationError(f"{what}: {heads} heads cannot be split into {size} shards; the file is corrupt")
    return len(per_span) * size, max(per_span.values()) * (heads // size) * head_dim


def _per_group(x: Any, groups: int, what: str) -> list[Any]:
    """A list with one entry per PCA group."""
    entries = _list(x, what, groups)
    if len(entries) != groups:
        raise CalibrationError(f"{what} has {len(entries)} entries for the grouping's {groups} groups")
    return entries


def _pca(d: Any, groups: int, what: str) -> None:
    if not isinstance(d, dict) or set(d) != set(_KINDS):
        raise CalibrationError(f"{what} must have entries for keys and values")
    for kind in _KINDS:
        for info in _per_group(d[kind], groups, f"{what} '{kind}'"):
            if not isinstance(info, dict) or not set(info) <= {"total_variance", "samples", "scaled"}:
                raise CalibrationError(f"{what} '{kind}' entries must be objects of total_variance, samples, scaled")
            if _number(info.get("total_variance"), f"{what} total_variance") < 0:
                raise CalibrationError(f"{what} total_variance must be non-negative; the file is corrupt")
            _int(info.get("samples"), f"{what} samples", 0, 1 << 62)
            if not isinstance(info.get("scaled", False), bool):
                raise CalibrationError(f"{what} 'scaled' must be true or false; the file is corrupt")


def _plans(d: Any, groups: int, width: int, what: str) -> None:
    if not isinstance(d, dict) or len(d) > MAX_RATIOS:
        raise CalibrationError(f"{what} must be an object of at most {MAX_RATIOS} ratios")
    segments = 0
    for key, by_kind in d.items():
        try:
            ratio = float(key)
        except ValueError:
            ratio = math.nan
        if not (len(key) <= 32 and math.isfinite(ratio) and ratio > 0):
            raise CalibrationError(f"{what}: ratio {_show(key)} is not a positive number; the file is corrupt")
        if not isinstance(by_kind, dict) or set(by_kind) != set(_KINDS):
            raise CalibrationError(f"{what} {_show(key)} must have plans for keys and values")
        for kind in _KINDS:
            for plan in _per_group(by_kind[kind], groups, f"{what} {_show(key)} '{kind}'"):
                segments += _plan(plan, width, f"{what} {_show(key)} '{kind}'")
                if segments > MAX_SEGMENTS:
                    raise CalibrationError(f"{what} declare more than {MAX_SEGMENTS} segments; the file is corrupt")


def _plan(p: Any, width: int, what: str) -> int:
    if (
        not isinstance(p, dict)
        or not {"segments", "predicted_error", "rows", "exact"} <= set(p)
        or not set(p) <= {"segments", "predicted_error", "rows", "exact", "clips"}
    ):
        raise CalibrationError(f"{what}: a bit plan must hold segments, predicted_error, rows, exact (and clips)")
    segs = _list(p["segments"], f"{what} segments", MAX_SEGMENTS)
    components = 0
    for seg in segs:
        if not isinstance(seg, list) or len(seg) != 3:
            raise CalibrationError(f"{what}: a segment must be [size, type, repeat]; the file is corrupt")
        size = _int(seg[0], f"{what} segment size", 1, MAX_FEATURES)
        _int(seg[1], f"{what} segment type", 0, max(TYPE_NAMES))
        if seg[1] not in TYPE_NAMES:
            raise CalibrationError(f"{what}: unknown quantization type {seg[1]}; the file is corrupt")
        components += size * _int(seg[2], f"{what} segment repeat", 1, MAX_FEATURES)
        if components > width:
            raise CalibrationError(
                f"{what}: the plan covers more components than its group's {width} features; the file is corrupt"
            )
    _number(p["predicted_error"], f"{what} predicted_error")
    _int(p["rows"], f"{what} rows", 0, 1 << 62)
    if not isinstance(p["exact"], bool):
        raise CalibrationError(f"{what} 'exact' must be true or false; the file is corrupt")
    for c in _list(p.get("clips", []), f"{what} clips", MAX_FEATURES):
        # clips lie in (0, 1], a fixed-step group's step is a positive float32 whose largest code stays finite
        # (the plan checks which is which); a step that is zero, denormal or overflows in float32 never decodes
        if not MIN_STEP <= _number(c, f"{what} clip") <= MAX_STEP:
            raise CalibrationError(
                f"{what}: clips and steps must be positive floats in [{MIN_STEP:.3g}, {MAX_STEP:.3g}] (normal "
                f"float32 whose largest code stays finite), got {_show(c)}; the file is corrupt: rebuild the "
                "calibration (`kvtc calibrate`)"
            )
    return len(segs)


def header_length(first: bytes, size: int, source: Any) -> int:
    """The length of a safetensors file's JSON header from its first 8 bytes, refused (before anything is read
    or allocated) unless it fits the file of ``size`` bytes and :data:`MAX_HEADER_BYTES`."""
    if len(first) < 8 or size < 8:
        raise CalibrationError(f"{source} is not a calibration: too short to hold a safetensors header")
    n = int.from_bytes(first[:8], "little")
    if not 2 <= n <= min(size - 8, MAX_HEADER_BYTES):
        raise CalibrationError(
            f"{source} is not a calibration: its header length {n} does not fit the file of {size} bytes "
            f"(or is more than {MAX_HEADER_BYTES}); {_HOSTILE}"
        )
    return n


def read_header(raw: bytes, source: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """A safetensors header's tensor table and its metadata, checked before any tensor is read: the JSON bounded
    as :func:`parse_json` bounds it, at most :data:`MAX_TENSORS` tensors, and metadata that is what safetensors
    defines (an object of strings) with at most :data:`MAX_META_ENTRIES` entries, each key at most
    :data:`MAX_TEXT` characters and each value at most :data:`MAX_META_BYTES`."""
    header = parse_json(raw, source, MAX_HEADER_BYTES)
    if not isinstance(header, dict):
        raise CalibrationError(f"{source} is not a calibration: its safetensors header is not a JSON object")
    metadata = header.get("__metadata__", {})
    table = {name: entry for name, entry in header.items() if name != "__metadata__"}
    if len(table) > MAX_TENSORS:
        raise CalibrationError(
            f"{source}: {len(table)} tensors, more than the {MAX_TENSORS} a calibration may hold; {_HOSTILE}"
        )
    if not all(isinstance(entry, dict) for entry in table.values()):
        raise CalibrationError(f"{source} is not a calibration: a tensor table entry is not an object")
    if not isinstance(metadata, dict) or len(metadata) > MAX_META_ENTRIES:
        raise CalibrationError(
            f"{source}: safetensors metadata must be an object of at most {MAX_META_ENTRIES} strings, got "
            f"{_show(metadata)}; {_HOSTILE}"
        )
    for key, value in metadata.items():
        if len(key) > MAX_TEXT or not isinstance(value, str) or len(value) > MAX_META_BYTES:
            raise CalibrationError(
                f"{source}: safetensors metadata entry {_show(key)} must be a string of at most {MAX_META_BYTES} "
                f"characters, got {_show(value)}; {_HOSTILE}"
            )
    return table, metadata


def kvtc_meta(metadata: dict[str, str], source: Any) -> dict[str, Any]:
    """The validated kvtc metadata of a safetensors file's metadata (:func:`read_header`)."""
    raw = metadata.get("kvtc")
    if raw is None:
        raise CalibrationError(f"{source} is a safetensors file but not a kvtc calibration (no kvtc metadata)")
    return read_meta(raw, source)


def read_meta(raw: Any, source: Any) -> dict[str, Any]:
    """A calibration file's ``kvtc`` metadata, parsed and validated (:func:`validate_meta`) before any tensor is read:
    anything but a string of at most :data:`MAX_META_BYTES` is refused before it is parsed."""
    if not isinstance(raw, str):
        raise CalibrationError(
            f"{source}: calibration metadata must be a string, got {type(raw).__name__}; the file is corrupt"
        )
    meta = parse_json(raw, source)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CalibrationError(f"{source} is not a kvtc calibration")
    validate_meta(meta, source)
    return meta


def tensor_names(meta: dict[str, Any]) -> set[str]:
    """The tensor names a file of this (validated) metadata must hold, no more and no fewer."""
    try:
        names = {
            f"{kind}.{g}.{part}"
            for kind in _KINDS
            for g in range(len(meta["pca"][kind]))
            for part in ("mean", "basis", "eigenvalues")
        }
        names |= {
            f"{kind}.{g}.scale" for kind in _KINDS for g, info in enumerate(meta["pca"][kind]) if info.get("scaled")
        }
        if meta.get("queries") is not None:
            names |= {"queries", "queries.scale"}
            if meta["queries"].get("map"):
                names |= {"queries.map", "queries.map.scale", "queries.map.bias"}
        if meta.get("token_map") is not None:
            names |= {"tokens.mean", "tokens.std", "tokens.probe", "tokens.keys", "tokens.values"}
            names |= {"tokens.keys.scale", "tokens.values.scale"}
        return names
    except (KeyError, TypeError, AttributeError):
        raise CalibrationError("calibration metadata lacks its PCA table; the file is corrupt") from None
