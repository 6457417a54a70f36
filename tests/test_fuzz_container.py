"""Container v1 under hostile input: a bounded slice of the fuzz campaign (``fuzz/fuzz_container.py``).

Every input goes through ``container.read_header``, ``Codec.inspect``, ``Codec(calibration).decode`` (and
``decode_layers``) and ``Codec.identity().decode``; ``check_input`` fails when anything but a
``kvtc.errors.KVTCError`` escapes, when the input takes 1 s or more, or when allocation exceeds the bound
computed from the validated header (small for rejected inputs). Kinds of input: random bytes, byte
flips, insertions/deletions, truncations, header JSON mutations re-sealed with a valid CRC (so the JSON
validation runs, not only the CRC), huge declared sizes, wrong types, nested junk, and headers whose
sections are rebuilt to the sizes the decoder expects (so mutated values reach the tensor code).
"""

from __future__ import annotations

import importlib.util
import json
import random
import struct
import sys
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtc.codec import Codec, container
from kvtc.errors import FormatError, KVTCError

ROOT = Path(__file__).resolve().parent.parent


def _load_fuzz_module():
    name = "kvtc_fuzz_container"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "fuzz" / "fuzz_container.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


fz = _load_fuzz_module()
KV = fz._load()
SEEDS: list[bytes] = KV["seeds"]
FIXTURE = SEEDS[0]

HYP = settings(
    max_examples=250,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


def check(data: bytes) -> fz.Outcome:
    """The fuzz properties for one input (raises ``FuzzFailure`` with the input and a stack trace)."""
    return fz.check_input(bytes(data))


def reseal(d, body: bytes = b"") -> bytes:
    return fz.seal(json.dumps(d, separators=(",", ":"), sort_keys=True).encode(), body)


def header_dict(blob: bytes = FIXTURE) -> dict:
    hdr, _ = fz.split_blob(blob)
    return json.loads(hdr)


def body_of(blob: bytes = FIXTURE) -> bytes:
    return fz.split_blob(blob)[1]


# ----------------------------------------------------------------------------------------- the seeds
def test_every_seed_is_a_valid_blob_that_decodes():
    assert len(SEEDS) >= 15
    for blob in SEEDS:
        out = check(blob)
        assert out.header_valid
        assert "ok" in (out.results["decode_kvtc"], out.results["decode_identity"]), out.results


# ---------------------------------------------------------------------------------- byte-level inputs
@HYP
@given(st.binary(max_size=4096))
def test_random_bytes(data):
    check(data)


@HYP
@given(
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFFFFFFFF),
    st.integers(0, 0xFFFFFFFF),
    st.binary(max_size=2048),
)
def test_random_bytes_behind_a_kvtc_prefix(version, flags, hlen, crc, rest):
    check(struct.pack("<4sHHII", b"KVTC", version % 3, flags % 3, hlen, crc) + rest)


_OPS = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete", "truncate", "extend"]),
    st.integers(0, 1 << 16),
    st.binary(min_size=1, max_size=32),
)


@HYP
@given(st.integers(0, len(SEEDS) - 1), st.lists(_OPS, min_size=1, max_size=6))
def test_byte_mutations_of_real_blobs(which, ops):
    b = bytearray(SEEDS[which])
    for op, pos, payload in ops:
        i = pos % (len(b) + 1)
        if op == "flip" and b:
            b[i % len(b)] ^= payload[0] or 1
        elif op == "set" and b:
            b[i % len(b)] = payload[0]
        elif op == "insert":
            b[i:i] = payload
        elif op == "delete":
            del b[i : i + len(payload)]
        elif op == "truncate":
            del b[i:]
        else:
            b += payload
    check(bytes(b))


def test_every_truncation_of_every_seed():
    for blob in SEEDS:
        step = max(1, len(blob) // 200)
        for n in range(0, len(blob), step):
            assert not check(blob[:n]).header_valid


@HYP
@given(st.randoms(use_true_random=False))
def test_the_fuzzers_own_mutators(rng):
    _, data = fz.mutate(rng, SEEDS)
    check(data)


# -------------------------------------------------------------------------- header JSON, valid CRC
_JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.sampled_from(fz.INTERESTING_INTS)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(fz.INTERESTING_STRS)
)
JUNK = st.recursive(
    _JSON_LEAF, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=12), c, max_size=5), max_leaves=25
)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


FIXTURE_PATHS = [p for p in _paths(header_dict()) if p]


@HYP
@given(st.integers(0, len(SEEDS) - 1), st.data(), st.booleans())
def test_header_field_replaced_with_junk_and_resealed(which, data, fix_body):
    d = header_dict(SEEDS[which])
    paths = [p for p in _paths(d) if p]
    path = data.draw(st.sampled_from(paths))
    node = d
    for p in path[:-1]:
        node = node[p]
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        node[path[-1]] = data.draw(JUNK)
    elif action == "delete":
        del node[path[-1]]
    elif isinstance(node, dict):
        node[data.draw(st.text(max_size=12))] = data.draw(JUNK)
    else:
        node.append(data.draw(JUNK))
    body = body_of(SEEDS[which])
    if fix_body:
        body = fz._fix_body(random.Random(0), d, body)
    check(reseal(d, body))


@HYP
@given(st.integers(0, len(SEEDS) - 1), JUNK)
def test_whole_header_replaced_with_junk(which, junk):
    check(reseal(junk, body_of(SEEDS[which])))


@HYP
@given(st.integers(0, len(SEEDS) - 1), st.integers(0, 4), st.sampled_from(fz.INTERESTING_INTS), st.booleans())
def test_section_table_sizes_and_crcs(which, field, value, recrc):
    d = header_dict(SEEDS[which])
    body = body_of(SEEDS[which])
    for s in d["sections"][: 1 + value % 3]:
        s[2 + field % 3] = value
    body = fz._fix_body(random.Random(0), d, body)
    if recrc:
        off = 0
        for s in d["sections"]:
            if 0 <= s[3] <= len(body):
                s[4] = zlib.crc32(body[off : off + s[3]])
                off += s[3]
    check(reseal(d, body))


@HYP
@given(st.randoms(use_true_random=False), st.integers(0, len(SEEDS) - 1))
def test_slice_fields_changed_and_sections_rebuilt_to_expected_sizes(rng, which):
    d = fz.mutate_fields_deep(rng, header_dict(SEEDS[which]))
    blob = fz.rebuild_sections(rng, d, lie=rng.random() < 0.3)
    if blob is not None:
        check(blob)


@HYP
@given(st.integers(0, len(SEEDS) - 1), st.randoms(use_true_random=False))
def test_header_text_edits_resealed(which, rng):
    hdr, body = fz.split_blob(SEEDS[which])
    check(fz.seal(fz.mutate_json_text(rng, hdr), body))


# ------------------------------------------------------------------ hostile sizes, explicit cases
def _hostile_cases():
    d0 = header_dict()
    lay = d0["layout"]
    cases = {}

    def case(name, **changes):
        d = json.loads(json.dumps(d0))
        for k, v in changes.items():
            if k.startswith("layout_"):
                d["layout"][k[7:]] = v
            elif k.startswith("sec") and k[3].isdigit():
                i, j = int(k[3]), int(k[5])
                d["sections"][i][j] = v
            else:
                d[k] = v
        cases[name] = reseal(d, body_of())

    for big in (1 << 22, (1 << 22) + 1, 1 << 31, 1 << 40, 1 << 63, 10**30):
        case(f"tokens_{big}", tokens=big)
        case(f"batch_{big}", batch=big)
        case(f"sinks_window_{big}", sinks=big, window=big)
        case(f"raw_{big}", sec0_2=big)
        case(f"coded_{big}", sec1_3=big)
        case(f"head_dim_{big}", layout_head_dim=big)
        case(f"layers_{big}", layout_layers=[0, big])
        case(f"kv_heads_{big}_all", layout_num_kv_heads=big, layout_heads=[])
    case("kv_heads_65537_all", layout_num_kv_heads=65537, layout_heads=[])
    case("kv_heads_3M_all", layout_num_kv_heads=3_000_000, layout_heads=[])
    case("layers_many", layout_layers=list(range(100000)))
    case("sections_many", sections=[[f"s{i}", "raw", 0, 0, 0] for i in range(5000)])
    case("sections_nested", sections=[[[[[]]]]] * 100)
    case("layout_wrong_types", layout={"layers": "0,3", "num_kv_heads": 2.0, "head_dim": True, "heads": {}, "dtype": 1})
    case("crc_negative", sec0_4=-1)
    case("crc_too_big", sec0_4=1 << 32)
    case("bool_sizes", sec0_2=True, sec0_3=False)
    case("float_sizes", sec0_2=320.0)
    case("backend_evil", sec1_1="../../evil")
    case("mode_wrong_type", mode=["kvtc"])
    case("calibration_huge", calibration="0" * 100000)
    case("model_id_huge", model_id="m" * 500000)
    case("dtype_unknown", layout_dtype="float64")
    case("ratio_nan", ratio="nan")
    cases["hlen_max"] = struct.pack("<4sHHII", b"KVTC", 1, 0, 0xFFFFFFFF, 0) + FIXTURE[16:]
    cases["hlen_1mib_plus_1"] = struct.pack("<4sHHII", b"KVTC", 1, 0, (1 << 20) + 1, 0) + bytes(1 << 20)
    deep = b"[" * 100000 + b"]" * 100000
    cases["json_nested_100k"] = fz.seal(deep, b"")
    cases["json_nested_unclosed"] = fz.seal(b"[" * 200000, b"")
    cases["json_nested_in_dtype"] = fz.seal(
        json.dumps(d0, separators=(",", ":"), sort_keys=True).replace('"bfloat16"', "[" * 5000 + "]" * 5000).encode(),
        b"",
    )
    cases["json_many_dicts"] = fz.seal(b"[" + b"{}," * 300000 + b"{}]", b"")
    cases["json_huge_int"] = fz.seal(b'{"batch": ' + b"9" * 5000 + b"}", b"")
    cases["json_utf16"] = fz.seal(json.dumps(d0).encode("utf-16"), body_of())
    cases["json_lone_surrogate"] = fz.seal(
        json.dumps(d0, separators=(",", ":"), sort_keys=True).replace('"fixture"', '"\\ud800"').encode(), body_of()
    )
    cases["json_bad_utf8"] = fz.seal(b'{"mode": "\xff\xfe"}', b"")
    _ = lay
    return cases


HOSTILE = _hostile_cases()


#: headers the container accepts (the values are within its caps and well typed); the decoders refuse them
#: (a ratio as kvtc never writes it is refused by the container itself)
#: because the sections do not have the sizes those values imply, or the calibration does not match
HEADER_ACCEPTS = {
    "backend_evil",
    "layers_many",
    "tokens_4194304",
    "sinks_window_4194304",
    "head_dim_4194304",
    "json_lone_surrogate",
} | {f"layers_{b}" for b in (1 << 22, (1 << 22) + 1, 1 << 31, 1 << 40, 1 << 63, 10**30)}
#: a "\ud800" escape is valid JSON: the blob decodes, with a model id that is not encodable as UTF-8
DECODES = {"json_lone_surrogate"}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_declared_sizes_and_types_are_rejected_cheaply(name):
    out = check(HOSTILE[name])
    assert out.header_valid == (name in HEADER_ACCEPTS), out.results
    decoded = any(out.results[k] == "ok" for k in ("decode_kvtc", "decode_layers", "decode_identity"))
    assert decoded == (name in DECODES), out.results
    assert out.py_peak < 64 << 20


# ---------------------------------------------------------- regressions found by the fuzzer (issue 5)
def _identity_blob_with_middle_tokens(batch=1):
    lay = header_dict()["layout"]
    pos = bytes(8 * batch * 3)
    d = {
        "mode": "identity",
        "calibration": None,
        "model_id": "x",
        "layout": lay,
        "batch": batch,
        "tokens": 3,
        "sinks": 0,
        "window": 0,
        "ratio": None,
        "packing": "bits",
        "sections": [
            ["positions", "raw", len(pos), len(pos), zlib.crc32(pos)],
            ["raw.keys", "raw", 0, 0, 0],
            ["raw.values", "raw", 0, 0, 0],
        ],
    }
    return reseal(d, pos)


def test_regression_identity_blob_with_middle_tokens_is_a_format_error():
    # was: AttributeError ('NoneType' object has no attribute 'columns') from Codec.identity().decode,
    # KeyError (None / 'keys.0.params') from Codec(calibration).decode
    blob = _identity_blob_with_middle_tokens()
    with pytest.raises(FormatError):
        container.read_header(blob)
    for fn in (Codec.identity().decode, KV["kvtc_codec"].decode, Codec.inspect):
        with pytest.raises(FormatError):
            fn(blob)
    check(blob)


def test_regression_deeply_nested_header_json_is_a_format_error():
    # was: RecursionError from json.loads inside container.read_header
    with pytest.raises(FormatError):
        container.read_header(fz.seal(b"[" * 100000, b""))


def test_regression_huge_kv_head_count_is_refused_before_the_layout_is_built():
    # was: KVLayout(heads=()) building tuple(range(num_kv_heads)): 330 MiB and 0.6 s for 3e6 heads,
    # MemoryError for 2**62, OverflowError for 2**70
    for nkv in (3_000_000, 1 << 62, 1 << 70):
        d = header_dict()
        d["layout"].update(num_kv_heads=nkv, heads=[])
        t0 = time.perf_counter()
        with pytest.raises(FormatError):
            container.read_header(reseal(d, body_of()))
        assert time.perf_counter() - t0 < 0.1


def test_regression_empty_batch_with_middle_tokens_is_a_format_error():
    # was: ZeroDivisionError in Codec.inspect (bytes_per_middle_token) and RuntimeError ("cannot reshape
    # tensor of 0 elements into shape [-1, 16, 0]") in Codec(calibration).decode, for batch 0 with middle
    # tokens; the encoder cannot write such a blob (an empty batch stores no token at all)
    d = header_dict()
    d.update(batch=0, tokens=10, sinks=0, window=0)
    for s in d["sections"]:
        s[1:] = ["raw", 0, 0, 0]  # an empty stream is stored raw
    blob = reseal(d)
    for fn in (container.read_header, Codec.inspect, KV["kvtc_codec"].decode, Codec.identity().decode):
        with pytest.raises(FormatError):
            fn(blob)
    check(blob)
    # an empty batch whose tokens are all protected (what the encoder writes) still opens
    d.update(sinks=4, window=128)
    d["sections"] = d["sections"][:3]
    assert Codec.inspect(reseal(d))["batch"] == 0


def test_regression_header_must_be_utf8():
    # was: accepted (json.loads on bytes also detects UTF-16/32 and a UTF-8 BOM); the format says UTF-8
    hdr, body = fz.split_blob(FIXTURE)
    for enc in ("utf-16", "utf-32", "utf-8-sig"):
        with pytest.raises(FormatError):
            container.read_header(fz.seal(hdr.decode().encode(enc), body))


# ------------------------------------------------------------------------ the bounded campaign slice
def test_bounded_mutation_loop():
    stats = fz.run_loop(runs=4000, seconds=25, seed=5)
    assert not stats.failures, stats.failure_examples[:2]
    assert stats.inputs >= 1000
    assert stats.header_valid > stats.inputs // 10  # the resealing mutators get past the CRC
    assert stats.fully_decoded > 0
    assert stats.slowest_s < fz.TIME_LIMIT_S
    for name in stats.errors_by_type:
        assert name in ("FormatError", "CalibrationMismatch", "CalibrationError", "LayoutError")


# ---------------------------------------------------------------- the checker itself catches violations
def test_the_checker_reports_foreign_exceptions_slowness_and_over_allocation(monkeypatch):
    def boom(b):
        raise KeyError("x")

    def slow(b):
        time.sleep(fz.TIME_LIMIT_S + 0.05)
        raise FormatError("slow")

    def hog(b):
        x = bytearray(8 << 20)
        raise FormatError(f"hog {len(x)}")

    for fn, kind in ((boom, "exception"), (slow, "slow"), (hog, "alloc")):
        monkeypatch.setitem(KV, "targets", [("read_header", fn)])
        with pytest.raises(fz.FuzzFailure) as e:
            check(b"x" * 100)
        assert e.value.kind == kind
    monkeypatch.setitem(KV, "targets", [("read_header", lambda b: (_ for _ in ()).throw(FormatError("fine")))])
    assert check(b"x").results == {"read_header": "FormatError"}
    assert issubclass(FormatError, KVTCError)
