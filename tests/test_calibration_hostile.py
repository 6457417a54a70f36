"""Hostile calibration files: whatever their metadata declares (types, nesting, numbers, counts), loading gives
a CalibrationError or a valid calibration, never another exception, within bounded memory and time.

Each case is a real safetensors file: the checked-in fixture calibration's tensors with its metadata mutated
by hypothesis (a field replaced by arbitrary JSON, deep nesting, NaN / infinite / huge numbers, long lists).
"""

from __future__ import annotations

import copy
import json
import re
import struct
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from kvtc.calibration import Calibration
from kvtc.errors import CalibrationError

FIX = Path(__file__).parent / "fixtures" / "calibration.safetensors"
_HWM = re.compile(rb"VmHWM:\s+(\d+) kB")


def _base() -> tuple[dict, bytes]:
    data = FIX.read_bytes()
    with safe_open(str(FIX), framework="pt") as f:
        meta = json.loads(f.metadata()["kvtc"])
    return meta, data


BASE_META, BASE_BYTES = _base()


def _with_meta(meta_text: str) -> bytes:
    """The fixture file with its kvtc metadata replaced (tensor table and data unchanged)."""
    n = int.from_bytes(BASE_BYTES[:8], "little")
    header = json.loads(BASE_BYTES[8 : 8 + n])
    header["__metadata__"] = {"kvtc": meta_text}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + BASE_BYTES[8 + n :]


def _hwm() -> int:
    with open("/proc/self/status", "rb") as f:
        m = _HWM.search(f.read())
    return int(m.group(1)) * 1024 if m else 0


def _load_bounded(meta_text: str) -> None:
    data = _with_meta(meta_text)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _hwm()
    except OSError:
        base = None
    t0 = time.perf_counter()
    try:
        Calibration.from_bytes(data)
    except CalibrationError:
        pass
    assert time.perf_counter() - t0 < 2.0  # linear in the file: a 1M-entry list parses in ~0.1 s on a quiet core
    if base is not None:
        assert _hwm() - base < 64 << 20


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(1 << 200), max_value=1 << 200)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=30,
)


def _paths(x, prefix=()):
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x[:8]):
            yield from _paths(v, (*prefix, i))


PATHS = [p for p in _paths(BASE_META) if p]


def _replace(meta, path, value):
    meta = copy.deepcopy(meta)
    node = meta
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return meta


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), value=json_values)
def test_any_field_replaced_by_any_json(path, value):
    _load_bounded(json.dumps(_replace(BASE_META, path, value), allow_nan=True))


@settings(max_examples=30, deadline=None)
@given(path=st.sampled_from(PATHS), depth=st.integers(min_value=1, max_value=200_000))
def test_deep_nesting_anywhere(path, depth):
    meta = _replace(BASE_META, path, "@@")
    text = json.dumps(meta).replace('"@@"', "[" * depth + "]" * depth, 1)
    _load_bounded(text)


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(["layers", "heads", "num_kv_heads", "head_dim"]),
    count=st.integers(min_value=0, max_value=1 << 40),
)
def test_huge_counts(field, count):
    lay = dict(BASE_META["layout"])
    if field in ("layers", "heads"):
        lay[field] = list(range(min(count, 1_000_000)))
    else:
        lay[field] = count
    _load_bounded(json.dumps({**BASE_META, "layout": lay}))


def test_a_million_layers_is_refused_quickly():
    meta = copy.deepcopy(BASE_META)
    n = 1_000_000
    meta["layout"]["layers"] = list(range(n))
    text = json.dumps(meta)
    t0 = time.perf_counter()
    with pytest.raises(CalibrationError, match="layers"):
        Calibration.from_bytes(_with_meta(text))
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "1e999", "1" * 5000])
def test_non_finite_and_huge_numbers_are_refused(bad):
    meta = copy.deepcopy(BASE_META)
    meta["pca"]["keys"][0]["total_variance"] = "@@"
    with pytest.raises(CalibrationError):
        Calibration.from_bytes(_with_meta(json.dumps(meta).replace('"@@"', bad)))


def test_huge_segment_repeat_is_refused_without_expanding_it():
    meta = copy.deepcopy(BASE_META)
    key = next(iter(meta["plans"]))
    meta["plans"][key]["keys"][0]["segments"] = [[1, 1, 10**15]]
    t0 = time.perf_counter()
    with pytest.raises(CalibrationError, match="repeat"):
        Calibration.from_bytes(_with_meta(json.dumps(meta)))
    assert time.perf_counter() - t0 < 1.0


def test_the_unmodified_file_still_loads():
    cal = Calibration.from_bytes(_with_meta(json.dumps(BASE_META)))
    assert cal.hash == BASE_META["hash"]
    assert Calibration.load(FIX).hash == cal.hash
