"""Hostile calibration files: whatever their metadata declares (types, nesting, numbers, counts), loading gives
a CalibrationError or a valid calibration, never another exception, within bounded memory and time.

Each case is a real safetensors file: the checked-in fixture calibration's tensors with its metadata mutated
by hypothesis (a field replaced by arbitrary JSON, deep nesting, NaN / infinite / huge numbers, long lists).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import functools
import json
import math
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from kvtc.calibration import Calibration
from kvtc.calibration.meta import FORMAT_VERSION
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


# ------------------------------------------------------------------------------------------ round 2: the header
# The safetensors header's metadata is dict[str, str]: anything else (a number, a list, null, an object, a huge
# integer) is a CalibrationError before anything is parsed or allocated, from bytes and from a file alike.

_TMP = Path(tempfile.mkdtemp(prefix="kvtc-hostile-"))
atexit.register(shutil.rmtree, _TMP, True)


def _header_with(metadata_text: str, base: bytes = BASE_BYTES) -> bytes:
    """``base`` with its safetensors ``__metadata__`` replaced by raw JSON text (which may hold numbers no Python
    int of the test builds)."""
    n = int.from_bytes(base[:8], "little")
    header = json.loads(base[8 : 8 + n])
    header["__metadata__"] = "@@META@@"
    raw = json.dumps(header).replace('"@@META@@"', metadata_text).encode("utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + base[8 + n :]


def _both_refuse(data: bytes, limit_s: float = 0.5, match: str | None = None) -> None:
    """Calibration.from_bytes(data) and Calibration.load(file of data) each raise CalibrationError (never another
    exception), within ``limit_s`` and 64 MB of peak RSS."""
    path = _TMP / "cal.safetensors"
    path.write_bytes(data)
    for load in (lambda: Calibration.from_bytes(data), lambda: Calibration.load(path)):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = _hwm()
        except OSError:
            base = None
        t0 = time.perf_counter()
        with pytest.raises(CalibrationError, match=match):
            load()
        assert time.perf_counter() - t0 < limit_s
        if base is not None:
            assert _hwm() - base < 64 << 20


def _digits(n: int) -> str:
    return "9" * n


non_strings = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**6, max_value=10**15).map(str),  # bytes(n) of these allocated n bytes
    st.integers(min_value=25, max_value=200_000).map(_digits),  # a JSON integer of that many digits
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]),
    st.lists(st.integers(), max_size=4).map(json.dumps),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3).map(json.dumps),
)


def _as_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=non_strings, where=st.sampled_from(["kvtc", "extra", "whole"]))
def test_metadata_that_is_not_strings_is_refused(value, where):
    kvtc = json.dumps(json.dumps(BASE_META))
    text = _as_text(value)
    if where == "kvtc":
        metadata = '{"kvtc": ' + text + "}"
    elif where == "extra":
        metadata = '{"kvtc": ' + kvtc + ', "other": ' + text + "}"
    else:
        metadata = text
    _both_refuse(_header_with(metadata))


def test_a_metadata_number_is_refused_without_allocating_it():
    # the old reader turned the kvtc entry into bytes(n): 10**12 is a terabyte
    for n in ("100000000", "1000000000000", _digits(5000)):
        _both_refuse(_header_with('{"kvtc": ' + n + "}"), match="must be a string|digits")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(min_value=1 << 16, max_value=4 << 20), where=st.sampled_from(["kvtc", "extra"]))
def test_huge_metadata_strings_are_refused_or_loaded_quickly(size, where):
    # a long string is no danger: the kvtc entry must still be valid metadata, an extra entry is ignored
    junk = json.dumps("x" * size)
    kvtc = json.dumps(json.dumps(BASE_META))
    metadata = '{"kvtc": ' + junk + "}" if where == "kvtc" else '{"kvtc": ' + kvtc + ', "other": ' + junk + "}"
    data = _header_with(metadata)
    t0 = time.perf_counter()
    if where == "kvtc":
        _both_refuse(data)
    else:
        assert Calibration.from_bytes(data).hash == BASE_META["hash"]
    assert time.perf_counter() - t0 < 1.0


def test_metadata_strings_longer_than_the_bound_are_refused(monkeypatch):
    from kvtc.calibration import meta

    monkeypatch.setattr(meta, "MAX_META_BYTES", 1000)
    kvtc = json.dumps(json.dumps(BASE_META))
    _both_refuse(_header_with('{"kvtc": ' + kvtc + "}"), match="must be a string of at most 1000")
    monkeypatch.undo()
    many = ", ".join(f'"k{i}": "v"' for i in range(100))
    _both_refuse(_header_with('{"kvtc": ' + kvtc + ", " + many + "}"), match="at most 64 strings")


def test_the_safetensors_header_is_bounded_before_safetensors_reads_it():
    from kvtc.calibration.meta import MAX_TENSORS

    n = int.from_bytes(BASE_BYTES[:8], "little")
    header = json.loads(BASE_BYTES[8 : 8 + n])
    entry = next(v for k, v in header.items() if k != "__metadata__")
    many = dict(header)
    many.update({f"t{i}": {} for i in range(MAX_TENSORS + 1)})
    raw = json.dumps(many).encode()
    raw += b" " * (-len(raw) % 8)
    _both_refuse(struct.pack("<Q", len(raw)) + raw + BASE_BYTES[8 + n :], limit_s=2.0, match="tensors, more than")
    extra = dict(header, extra=entry)  # one unexpected tensor: refused before any tensor is loaded
    raw = json.dumps(extra).encode()
    raw += b" " * (-len(raw) % 8)
    _both_refuse(struct.pack("<Q", len(raw)) + raw + BASE_BYTES[8 + n :], match="missing or unexpected|do not match")
    for length in (0, 1, (1 << 64) - 1, len(BASE_BYTES), 100 << 20):
        _both_refuse(struct.pack("<Q", length) + BASE_BYTES[8:], match="header length")


# ------------------------------------------------------------------------------------------ round 2: the JSON
def _meta_text_with(path, token: str) -> str:
    """The fixture's metadata text with the field at ``path`` replaced by raw JSON text ``token``."""
    return json.dumps(_replace(BASE_META, path, "@@")).replace('"@@"', token, 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), digits=st.integers(min_value=25, max_value=300_000), negative=st.booleans())
def test_no_huge_integer_is_ever_built(path, digits, negative):
    token = "-" * negative + _digits(digits)
    _both_refuse(_with_meta(_meta_text_with(path, token)), match="digits")


def test_huge_integers_are_refused_even_without_pythons_digit_limit():
    # Python's own 4,300-digit limit can be lifted by the application: the reader must not depend on it
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        meta = dict(BASE_META, stats={"n": "@@"})
        text = json.dumps(meta).replace('"@@"', _digits(300_000))
        _both_refuse(_with_meta(text), match="digits")
        _both_refuse(_header_with('{"kvtc": ' + _digits(300_000) + "}"), match="digits")
    finally:
        sys.set_int_max_str_digits(old)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_non_finite_numbers_are_refused_in_free_form_fields_too(token):
    text = json.dumps(dict(BASE_META, stats={"x": [1, {"y": "@@"}]})).replace('"@@"', token)
    _both_refuse(_with_meta(text), match="not a number|overflows")


def test_nesting_is_bounded_before_parsing_even_under_a_raised_recursion_limit():
    # json.loads recurses in C: under a raised recursion limit a deep document overflows the C stack (a crash,
    # not an exception); the reader counts the nesting on the text first. Run in a child: a crash must not end
    # the test session.
    meta = json.dumps(dict(BASE_META, stats={"x": "@@"})).replace('"@@"', "[" * 200_000 + "]" * 200_000)
    data = _TMP / "deep.safetensors"
    data.write_bytes(_with_meta(meta))
    code = textwrap.dedent(
        f"""
        import sys
        from kvtc.calibration import Calibration
        from kvtc.errors import CalibrationError
        sys.setrecursionlimit(10**7)
        data = open({str(data)!r}, "rb").read()
        for load in (lambda: Calibration.from_bytes(data), lambda: Calibration.load({str(data)!r})):
            try:
                load()
            except CalibrationError as e:
                print("refused:", str(e)[:200])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("refused:") == 2 and "nested more than" in out.stdout, out.stdout


def test_scan_json_matches_a_reference_scanner():
    from kvtc.calibration import meta

    def reference(data: bytes):
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
        inside, depth, deepest, run, longest = False, 0, 0, 0, 0
        for ch in data:
            if ch == 0x22:
                inside, run = not inside, 0
            elif inside:
                run = 0
            else:
                if ch in b"[{":
                    depth += 1
                    deepest = max(deepest, depth)
                elif ch in b"]}":
                    depth -= 1
                    if depth < 0:
                        return None
                run = run + 1 if 0x30 <= ch <= 0x39 else 0
                longest = max(longest, run)
        return deepest, longest

    rng = random.Random(0)
    alphabet = b'[]{}"\\\\\\0123456789ab,:'
    cases = [bytes(rng.choice(alphabet) for _ in range(rng.randrange(60))) for _ in range(1500)]
    for chunk in (1, 3, 7, meta.SCAN_CHUNK):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(meta, "SCAN_CHUNK", chunk)
            for case in cases:
                assert meta.scan_json(case) == reference(case), (chunk, case)


# ------------------------------------------------------------------------------------------ round 2: tensors
# Every tensor a decode divides by or multiplies in must hold values it can use: a zero, negative, denormal or
# non-finite scale or standard deviation, a negative / denormal / non-finite eigenvalue, a non-finite mean, basis,
# query or token-map tensor is a CalibrationError naming the tensor, even in a file whose hash and checksum match.

E, VOCAB, G = 4, 64, 2


@functools.cache
def rich_calibration() -> Calibration:
    """A small calibration holding every kind of tensor: feature scales, mean queries and their map, a token map."""
    from kvtc import KVLayout
    from kvtc.calibration import Recipe, fit_calibration
    from kvtc.calibration.token_map import LAGS, PROBE_ROWS, TokenMap

    layout = KVLayout(layers=(0, 3), num_kv_heads=2, head_dim=8, dtype="float32")
    g = torch.Generator().manual_seed(7)
    p = layout.num_features
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
    sd = torch.logspace(0.5, -2, p)

    def rows(n: int) -> torch.Tensor:
        return (torch.randn(n, p, generator=g) * sd) @ q.T + 0.5

    scales = {"keys": torch.rand(p, generator=g) + 0.5, "values": torch.rand(p, generator=g) + 0.5}
    cal = fit_calibration(
        layout, [(rows(256), rows(256) * 0.3)], Recipe(ratios=(4, 8), dp_rows=128), feature_scale=scales
    )
    f = LAGS * E
    token_map = TokenMap.from_weights(
        LAGS,
        VOCAB,
        torch.randn(f, generator=g),
        torch.rand(f, generator=g) + 0.1,
        {k: (torch.randn(f, p, generator=g) * 0.05).half() for k in ("keys", "values")},
        torch.randn(PROBE_ROWS, E, generator=g),
    )
    heads, d = len(layout.layers), layout.head_dim
    return dataclasses.replace(
        cal,
        stats={},
        queries=torch.randn(heads, 2, G, d, generator=g),
        query_scales=torch.full((heads,), d**-0.5),
        query_map=torch.randn(heads, 2, d + 1, G * d, generator=g) * 0.1,
        token_map=token_map,
    )


RICH = rich_calibration()
RICH_BYTES = RICH.to_bytes()
TINY = torch.finfo(torch.float32).tiny
F32_MAX = torch.finfo(torch.float32).max
#: bad values by what the tensor is to a decode
BAD = {
    "finite": [math.inf, -math.inf, math.nan],
    "spectrum": [math.inf, math.nan, -1.0, -TINY, TINY / 2, 1e-45],
    "divisor": [0.0, -0.0, -1.0, -TINY, TINY / 2, 1e-45, 1e-40, math.inf, -math.inf, math.nan],
    "std": [0.0, -1.0, 1e-40, 1e-7, 5e-7, math.inf, math.nan],
}
# the int8 token-map weights hold only finite values: their column scales are what a forger would break
ROLES = {name: "finite" for name, t in RICH._tensors().items() if t.is_floating_point()}
for _name in ROLES:
    ROLES[_name] = {"eigenvalues": "spectrum", "scale": "divisor"}.get(_name.rsplit(".", 1)[-1], "finite")
ROLES["queries.scale"] = "divisor"
ROLES["tokens.std"] = "std"
CHECKED = sorted(ROLES)


def _hostile_copy(name: str, index: int, value: float) -> tuple[Calibration, torch.Tensor]:
    """A deep copy of RICH with one value of tensor ``name`` set in place (no validation), its hash recomputed as
    a forger would; and the tensor."""
    cal = copy.deepcopy(RICH)
    target = {"queries": cal.queries, "queries.scale": cal.query_scales}.get(name)
    if name.startswith("queries.map."):  # parts of the file's map (the calibration holds it whole): forged there
        tensors = cal._tensors()
        target = tensors[name] = tensors[name].clone()
        cal._tensors = lambda queries=True: (
            tensors if queries else {n: t for n, t in tensors.items() if not n.startswith("queries")}
        )  # type: ignore[method-assign]
    elif target is None and name.startswith("tokens."):
        tm = cal.token_map
        part = name.split(".", 1)[1]
        kind = part.removesuffix(".scale")
        target = tm.scales[kind] if part != kind else tm.weights[part] if part in tm.weights else getattr(tm, part)
    elif target is None:
        kind, g, part = name.split(".")
        target = getattr(cal.pcas[kind][int(g)], part)
    flat = target.view(-1)
    flat[index % flat.numel()] = value
    cal.hash = cal._compute_hash()
    return cal, target


def test_the_rich_calibration_round_trips():
    assert set(CHECKED) >= {"keys.0.scale", "tokens.std", "queries.scale", "queries.map.scale", "tokens.keys.scale"}
    for cal in (Calibration.from_bytes(RICH_BYTES), Calibration.load(RICH.save(_TMP / "rich.safetensors"))):
        assert cal.hash == RICH.hash and cal.version == FORMAT_VERSION


@pytest.mark.parametrize("name", ["tokens.keys.scale", "queries.map.scale"])
def test_a_map_scale_that_would_dequantize_beyond_float16_is_refused(name):
    """An int8 map's column scale is bounded (a weight within float16's range, as the maps held before format 11): a
    forged scale near float32's largest, finite and positive, would dequantize to inf."""
    cal, _ = _hostile_copy(name, 0, 1e36)
    _both_refuse(cal.to_bytes(), match="column scales must be at most")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(CHECKED), index=st.integers(min_value=0, max_value=1 << 20), pick=st.integers(0, 99))
def test_a_value_no_decode_can_use_is_refused_naming_the_tensor(name, index, pick):
    bad = BAD[ROLES[name]]
    value = bad[pick % len(bad)]
    cal, _ = _hostile_copy(name, index, value)
    data = cal.to_bytes()  # hash and checksum match: only the value is wrong
    _both_refuse(data, match=re.escape(repr(name)) + ".*rebuild the calibration")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["keys", "values"]),
    part=st.sampled_from(["basis", "mean"]),
    index=st.integers(min_value=0, max_value=1 << 20),
)
def test_a_weighted_coder_basis_that_overflows_is_refused(kind, part, index):
    # finite values whose product or quotient with the feature scale overflows float32: the coder's basis would
    # hold inf, so decoding would
    cal = copy.deepcopy(RICH)
    pca = cal.pcas[kind][0]
    target = getattr(pca, part)
    feature = index % pca.mean.numel()
    if part == "basis":
        # the basis is float16: its largest value over a normal float32 scale overflows basis / scale
        pca.scale[feature] = 1e-36
        target[index % target.shape[0], feature] = torch.finfo(target.dtype).max
    else:
        pca.scale[feature] = 0.75  # mean / scale overflows
        target[feature] = F32_MAX
    cal.hash = cal._compute_hash()
    _both_refuse(cal.to_bytes(), match=re.escape(f"{kind}.0") + ".*overflows float32.*rebuild the calibration")


@pytest.mark.parametrize(
    ("name", "value"),
    [("keys.0.scale", 1e-40), ("tokens.std", 1e-7), ("queries.scale", 1e-42), ("values.0.eigenvalues", 1e-40)],
)
def test_denormal_divisors_are_refused_in_memory_too(name, value):
    # the constructor validates what it is given: a calibration built in memory cannot hold them either
    cal = copy.deepcopy(RICH)
    with pytest.raises(CalibrationError, match="positive|normal|rebuild"):
        _hostile_copy_and_validate(cal, name, value)


def _hostile_copy_and_validate(cal: Calibration, name: str, value: float) -> None:
    bad, _ = _hostile_copy(name, 0, value)
    dataclasses.replace(bad)  # builds (and validates) a new Calibration of the same parts


def test_a_forged_denormal_scale_never_reaches_a_decode():
    # the old reader loaded this file (hash and checksum match) and decoded its keys to inf / NaN: the decode
    # basis of a weighted group is basis / scale
    from kvtc.codec import Codec
    from synthetic import make_slice

    plain = dataclasses.replace(RICH, queries=None, query_scales=None, query_map=None, token_map=None)
    g = torch.Generator().manual_seed(11)
    p = plain.layout.num_features
    kv = make_slice(plain.layout, torch.randn(600, p, generator=g), torch.randn(600, p, generator=g) * 0.3)
    codec = Codec(Calibration.from_bytes(plain.to_bytes()), 4)
    assert bool(torch.isfinite(codec.decode(codec.encode(kv)).keys).all())
    forged = copy.deepcopy(plain)
    forged.pcas["keys"][0].scale[3] = 1e-42
    assert not bool(torch.isfinite(forged.pcas["keys"][0].coder_basis(decode=True)[1]).all())
    forged.hash = forged._compute_hash()
    _both_refuse(forged.to_bytes(), match="'keys.0.scale'.*positive.*rebuild the calibration")
    with pytest.raises(CalibrationError, match="positive"):  # nor can one be built in memory
        pca = plain.pcas["keys"][0]
        type(pca)(pca.mean, pca.basis, pca.eigenvalues, pca.total_variance, pca.samples, forged.pcas["keys"][0].scale)


def test_steps_that_are_zero_or_denormal_in_float32_are_refused():
    from kvtc.calibration import Plan
    from kvtc.quant import INT4F, INT4S

    good = Plan(((16, INT4S, 1), (1, INT4F, 2)), clips=(1.0, 0.25, 3.5))
    assert Plan.from_dict(good.to_dict(), 64) == good
    for step in (1e-300, 1e-40, TINY / 2, 1e37, F32_MAX):  # 1e-300 is 0.0 in float32; 1e37 * 8 overflows it
        bad = dataclasses.replace(good, clips=(1.0, 0.25, step)).to_dict()
        with pytest.raises(CalibrationError, match="clips"):
            Plan.from_dict(bad, 64)
        meta = copy.deepcopy(BASE_META)
        key = next(iter(meta["plans"]))
        meta["plans"][key]["keys"][0]["clips"] = [step]
        _both_refuse(_with_meta(json.dumps(meta)), match="clips and steps")


def test_the_fit_writes_no_denormal_eigenvalue():
    from kvtc.calibration.pca import spectrum

    ev = spectrum(torch.tensor([2.0, 1e-39, 1e-300, -1e-12, 0.0], dtype=torch.float64))
    assert ev.dtype == torch.float32 and ev.tolist() == [2.0, 0.0, 0.0, 0.0, 0.0]
    from kvtc.calibration.validation import check_tensors

    check_tensors({"keys.0.eigenvalues": ev})  # zero is a legitimate eigenvalue


def test_checking_the_tensors_is_cheap_on_a_large_calibration():
    # a 5,760-wide weighted group (SmolLM2's feature count): two float16 bases of 66 MB each
    from kvtc.calibration.validation import check_tensors

    p = 5760
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for kind in ("keys", "values"):
        tensors[f"{kind}.0.basis"] = torch.empty(p, p).uniform_(-1, 1, generator=g).half()
        tensors[f"{kind}.0.mean"] = torch.randn(p, generator=g)
        tensors[f"{kind}.0.eigenvalues"] = torch.rand(p, generator=g)
        tensors[f"{kind}.0.scale"] = torch.rand(p, generator=g) + 0.5
    check_tensors(tensors)
    t0 = time.perf_counter()
    check_tensors(tensors)
    assert time.perf_counter() - t0 < 1.0  # ~0.04 s on a quiet core: one min/max pass over each tensor
