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
from ..quant import DROP, FIXED_TYPES, FP8, INT1S, INT2, INT4, TYPE_NAMES

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


#: Calibration file versions. 1: unweighted; 2: some PCA group carries a feature scale (a version-1 reader must
#: refuse it: ignoring the scale would decode garbage); 3: some plan uses a quantization type beyond the paper's
#: (int3 or a scale-only type, codes 4-8; an older reader refuses the file by its version instead of failing on an
#: unknown type); each was the lowest version that could hold the calibration. 4 (any content): the hash names
#: what decoding depends on, a checksum guards the rest; written unless the calibration came from an older file.
#: 5: version 4 whose plans use the 1-bit type int1s (code 9), which a version-4 reader does not know (a
#: calibration without it is still written as version 4, byte for byte as before).
#: 6: version 4 or 5 whose plans use a fixed-step type (int2f / int4f / int8f, codes 10-12: the plan's per-group
#: values are then steps, not clips in (0, 1]).
#: 7: any of 4-6 that also records each head's mean query (tensors ``queries`` and ``queries.scale``, metadata
#: ``queries``), which the encoder's token-adaptive rates read; a calibration without them is written as before.
#: 8: version 7 that also records the key-to-query map (tensor ``queries.map``, metadata ``queries`` ``map``).
#: 9: any of 4-8 that also carries a token map (tensors ``tokens.*``, metadata ``token_map``:
#: :mod:`kvtc.calibration.token_map`), which decoding needs; a calibration without one is written as before.
FORMAT_VERSION = 4
INT1_VERSION = 5
FIXED_VERSION = 6
QUERIES_VERSION = 7
QUERY_MAP_VERSION = 8
TOKEN_MAP_VERSION = 9
READ_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
#: type codes a version-1 or version-2 file may use
_V2_TYPES = frozenset({DROP, INT2, INT4, FP8})


def needed_version(types: frozenset[int], weighted: bool) -> int:
    """The lowest file version that can hold plans of quantization ``types`` (and feature scales if ``weighted``)."""
    if types & FIXED_TYPES:
        return FIXED_VERSION
    return INT1_VERSION if INT1S in types else 3 if not types <= _V2_TYPES else 2 if weighted else 1


def saved_version(
    types: frozenset[int],
    weighted: bool,
    legacy: bool,
    queries: bool = False,
    query_map: bool = False,
    token_map: bool = False,
) -> int:
    """The version a calibration is written in: its old file's lowest version (``legacy``), else 4, 5 or 6, 7
    when it records mean queries, 8 when it also records the key-to-query map, 9 when it carries a token map."""
    if legacy:
        return needed_version(types, weighted)
    if token_map:
        return TOKEN_MAP_VERSION
    if query_map:
        return QUERY_MAP_VERSION
    if queries:
        return QUERIES_VERSION
    return max(FORMAT_VERSION, needed_version(types, weighted))


def parse_json(raw: str | bytes, source: Any) -> Any:
    """``json.loads`` that refuses NaN / Infinity and nesting too deep to walk, as a CalibrationError."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number a calibration may hold")

    text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8", "replace")
    values = text.count(",") + text.count(":")
    if values > MAX_VALUES:
        raise CalibrationError(
            f"{source}: calibration metadata holds about {values} values, more than the "
            f"{MAX_VALUES} any calibration needs; the file is corrupt or hostile"
        )
    try:
        return json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise CalibrationError(
            f"{source}: calibration metadata is not valid JSON ({str(e)[:80]}); recreate the file"
        ) from None


def validate_meta(meta: Any, source: Any, versions: tuple[int, ...]) -> None:
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
    if version not in versions:
        raise CalibrationError(
            f"{source}: calibration format version {version} is not supported by this kvtc "
            f"(reads versions {', '.join(map(str, versions))}); upgrade kvtc or recalibrate"
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
    _pca(meta.get("pca"), groups, f"{where} 'pca'")
    _plans(meta.get("plans"), groups, width, f"{where} 'plans'")
    if version == QUERY_MAP_VERSION and meta.get("queries") is None:
        raise CalibrationError(f"{where}: a version-{version} file without its 'queries'; the file is corrupt")
    if (version == TOKEN_MAP_VERSION) != (meta.get("token_map") is not None):
        raise CalibrationError(f"{where}: a token map belongs in a version-9 file and only there; the file is corrupt")
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
        if version == TOKEN_MAP_VERSION:
            fields = {"per_kv_head", "map"} if isinstance(q, dict) and "map" in q else {"per_kv_head"}
        else:
            fields = {"per_kv_head", "map"} if version >= QUERY_MAP_VERSION else {"per_kv_head"}
        if (
            version < QUERIES_VERSION
            or not isinstance(q, dict)
            or set(q) != fields
            or ("map" in fields and q["map"] is not True)
        ):
            raise CalibrationError(
                f"{where} 'queries' is malformed or in a version-{version} file; the file is corrupt"
            )
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
            raise CalibrationError(f"{what} '{key}' must have plans for keys and values")
        for kind in _KINDS:
            for plan in _per_group(by_kind[kind], groups, f"{what} '{key}' '{kind}'"):
                segments += _plan(plan, width, f"{what} '{key}' '{kind}'")
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
        # clips lie in (0, 1], a fixed-step group's step is any positive float (the plan checks which is which)
        if not 0 < _number(c, f"{what} clip") < 3.4e38:
            raise CalibrationError(f"{what}: clips and steps must be positive floats; the file is corrupt")
    return len(segs)


def read_meta(raw: str, source: Any) -> dict[str, Any]:
    """A calibration file's ``kvtc`` metadata, parsed and validated (:func:`validate_meta`) before any tensor is read."""
    meta = parse_json(raw, source)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CalibrationError(f"{source} is not a kvtc calibration")
    validate_meta(meta, source, READ_VERSIONS)
    scaled = any(isinstance(i, dict) and i.get("scaled") for k in _KINDS for i in (meta.get("pca") or {}).get(k, []))
    if scaled and meta.get("version") < 2:
        raise CalibrationError(f"{source}: feature scales in a version-1 calibration; the file is corrupt")
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
                names.add("queries.map")
        if meta.get("token_map") is not None:
            names |= {"tokens.mean", "tokens.std", "tokens.probe", "tokens.keys", "tokens.values"}
        return names
    except (KeyError, TypeError, AttributeError):
        raise CalibrationError("calibration metadata lacks its PCA table; the file is corrupt") from None
