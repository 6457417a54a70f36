"""Fuzz target for the kvtc container v1 parser and decoders.

Every input goes through ``container.read_header``, ``Codec.inspect``, ``Codec(calibration).decode``,
``Codec(calibration).decode_layers`` and ``Codec.identity().decode``. Properties checked per input:

* only :class:`kvtc.errors.KVTCError` subclasses escape (anything else is a bug);
* the input finishes in under ``TIME_LIMIT_S`` (1 s) in each entry point, timed without the allocation
  tracer (the summary also reports the slowest input over all five together);
* allocation stays under a bound computed from the *validated* header (see :func:`alloc_bounds`):
  traced Python/numpy allocation (``tracemalloc``) for every input, and peak-RSS growth (Linux
  ``/proc/self/clear_refs`` + ``VmHWM``, which also sees torch's allocator) for inputs whose header
  validates. An input whose header is rejected may only allocate a small multiple of its own length.

Inputs are seed blobs (``corpus_seed.py``) mutated at the byte level (flips, insertions, deletions,
truncations, splices, prefix fields), at the header level (JSON tree and text mutations re-sealed with a
*valid* header CRC so the JSON validation itself is exercised, declared-size and section-table mutations)
and at the slice level (headers whose fields are changed and whose sections are rebuilt to exactly the
sizes the decoder expects, so mutated values reach the tensor code), plus random bytes.

Usage::

    python fuzz/fuzz_container.py --runs 1000000            # plain mutation loop (default)
    python fuzz/fuzz_container.py --seconds 60 --engine atheris CORPUS_DIR   # coverage-guided

Prints a JSON summary (inputs, outcomes and exceptions by type, slowest input, peak allocation) and
writes it to ``--out`` when given. Exit status 1 when any property was violated.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import platform
import random
import re
import resource
import struct
import sys
import threading
import time
import traceback
import tracemalloc
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import hwm, reset_hwm  # noqa: E402

TIME_LIMIT_S = 1.0
#: watchdog: an input still running after this long is written out and the process exits
HANG_S = 20.0
MAGIC = b"KVTC"
PREFIX = struct.Struct("<4sHHII")
#: traced Python allocation an input may always use: the blob copies and its parsed header JSON
#: (json.loads builds up to ~25 bytes of objects per header byte: "[{},{},...]")
PY_BASE = 1 << 20
PY_PER_INPUT_BYTE = 48
PY_PER_RAW_BYTE = 6
#: peak-RSS growth allowed for an input whose header validates (torch allocates outside tracemalloc):
#: int2/int4 planes are unpacked through int32 (16x a packed byte), coefficients and rows are float32
RSS_BASE = 64 << 20
RSS_PER_RAW_BYTE = 32
RSS_PER_DECODED_F32_BYTE = 8

_KV: dict[str, Any] = {}  # lazily imported kvtc pieces (so atheris can instrument them first)


def _load(instrument: bool = False) -> dict[str, Any]:
    if _KV:
        return _KV
    import numpy  # noqa: F401  (heavy dependencies are imported before kvtc, never instrumented)
    import torch  # noqa: F401

    if instrument:
        import atheris

        with atheris.instrument_imports(include=["kvtc"]):
            import kvtc.codec  # noqa: F401
    import corpus_seed

    from kvtc.codec import Codec, container
    from kvtc.coding.entropy import BACKENDS
    from kvtc.errors import KVTCError

    cal = corpus_seed.load_calibration()
    kvtc_codec = Codec(cal, ratio=8)
    ident = Codec.identity()

    def decode_layers(b: bytes) -> None:
        for _ in kvtc_codec.decode_layers(b):
            pass

    _KV.update(
        container=container,
        BACKENDS=BACKENDS,
        backends=sorted(BACKENDS),
        Codec=Codec,
        KVTCError=KVTCError,
        cal=cal,
        kvtc_codec=kvtc_codec,
        identity_codec=ident,
        targets=[
            ("read_header", container.read_header),
            ("inspect", Codec.inspect),
            ("decode_kvtc", kvtc_codec.decode),
            ("decode_layers", decode_layers),
            ("decode_identity", ident.decode),
        ],
        seeds=list(corpus_seed.build_seeds().values()),
    )
    return _KV


# ---------------------------------------------------------------------------------------------- checks
class FuzzFailure(AssertionError):
    """A property was violated: ``kind`` is ``exception``, ``slow`` or ``alloc``."""

    def __init__(self, kind: str, detail: str, data: bytes):
        super().__init__(f"{kind}: {detail} (input {len(data)} bytes, sha256 {_sha(data)[:16]})")
        self.kind, self.detail, self.data = kind, detail, data


@dataclass
class Outcome:
    results: dict[str, str]  # target -> "ok" or the KVTCError type name
    header_valid: bool
    seconds: float  # the slowest entry point
    total_seconds: float  # all entry points together
    py_peak: int
    py_bound: int
    rss_growth: int | None
    rss_bound: int | None


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def alloc_bounds(data: bytes, header: Any) -> tuple[int, int | None]:
    """(traced-Python bound, RSS-growth bound or None) for one input, from its validated header.

    Everything is linear in what the header declares and the validator has already bounded: the
    sections' declared raw sizes and the decoded slice (batch x tokens x features, both kinds).
    """
    py = PY_BASE + PY_PER_INPUT_BYTE * len(data)
    if header is None:
        return py, None
    raw = sum(s.raw for s in header.sections)
    decoded_f32 = 2 * header.batch * header.tokens * header.layout.num_features * 4
    return (
        py + PY_PER_RAW_BYTE * raw,
        RSS_BASE + PY_PER_INPUT_BYTE * len(data) + RSS_PER_RAW_BYTE * raw + RSS_PER_DECODED_F32_BYTE * decoded_f32,
    )


def check_input(data: bytes, measure_rss: bool = True, all_targets: bool = True) -> Outcome:
    """Run every target on ``data``; raise :class:`FuzzFailure` when a property is violated.

    ``all_targets=False`` (long runs): when ``read_header`` rejects the input, the other targets are not
    run; each of them starts with that same ``read_header`` call on the same bytes."""
    kv = _load()
    KVTCError = kv["KVTCError"]
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start(1)
    try:
        tracemalloc.reset_peak()
        py0 = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        header = None
        results: dict[str, str] = {}
        rss0 = None
        slowest = 0.0  # the limit is per entry point: a caller runs one of them on a blob
        for name, fn in kv["targets"]:
            t1 = time.perf_counter()
            try:
                r = fn(data)
                results[name] = "ok"
                if name == "read_header":
                    header = r[0]
                    if measure_rss:
                        rss0 = reset_hwm()
            except KVTCError as e:
                results[name] = type(e).__name__
                if name == "read_header" and not all_targets:
                    break
            except Exception as e:  # noqa: BLE001 - the property under test
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                raise FuzzFailure("exception", f"{name}: {type(e).__name__}: {e}\n{tb}", data) from e
            finally:
                slowest = max(slowest, time.perf_counter() - t1)
        seconds = time.perf_counter() - t0
        py_peak = tracemalloc.get_traced_memory()[1] - py0
    finally:
        if not tracing:
            tracemalloc.stop()
    rss_growth = hwm() - rss0 if rss0 is not None else None
    py_bound, rss_bound = alloc_bounds(data, header)
    out = Outcome(
        results, header is not None, slowest, seconds, py_peak, py_bound, rss_growth, rss_bound if rss0 else None
    )
    if slowest > TIME_LIMIT_S and not tracing:
        # tracemalloc slows Python-heavy parsing several-fold (a header with 100,000 layers: 0.12 s -> 0.7 s),
        # so what the limit is about, the code's own time, is measured again with the tracer off
        slowest = _untraced_slowest(kv, data)
    if slowest > TIME_LIMIT_S:
        raise FuzzFailure("slow", f"{slowest:.3f} s > {TIME_LIMIT_S} s in one entry point; results {results}", data)
    if py_peak > py_bound:
        raise FuzzFailure("alloc", f"traced peak {py_peak} B > bound {py_bound} B; results {results}", data)
    if rss_growth is not None and rss_growth > rss_bound:  # type: ignore[operator]
        raise FuzzFailure("alloc", f"peak RSS grew {rss_growth} B > bound {rss_bound} B; results {results}", data)
    return out


def _untraced_slowest(kv: dict[str, Any], data: bytes) -> float:
    """The slowest entry point's seconds on ``data`` with no allocation tracer running."""
    slowest = 0.0
    for _, fn in kv["targets"]:
        t1 = time.perf_counter()
        try:
            fn(data)
        except kv["KVTCError"]:
            pass
        slowest = max(slowest, time.perf_counter() - t1)
    return slowest


def one_input(data: bytes) -> None:
    """The fuzz target (atheris signature): returns, or raises on a property violation."""
    check_input(bytes(data))


# ------------------------------------------------------------------------------------------ mutators
INTERESTING_INTS = [
    0,
    1,
    -1,
    2,
    3,
    7,
    8,
    15,
    16,
    17,
    31,
    64,
    127,
    128,
    255,
    256,
    4095,
    4096,
    4097,
    65535,
    65536,
    65537,
    1 << 20,
    (1 << 20) + 1,
    (1 << 22),
    (1 << 22) + 1,
    (1 << 24) + 1,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 36,
    (1 << 36) + 1,
    1 << 53,
    (1 << 63) - 1,
    1 << 63,
    1 << 64,
    10**30,
    -(1 << 63),
    10**300,
]
INTERESTING_STRS = [
    "",
    "a",
    "kvtc",
    "identity",
    "raw",
    "zlib",
    "zstd",
    "bits",
    "bytes",
    "positions",
    "raw.keys",
    "raw.values",
    "keys.0.params",
    "keys.0.int2",
    "keys.0.int4",
    "keys.0.fp8",
    "values.0.params",
    "keys.1.params",
    "bfloat16",
    "float16",
    "float32",
    "int8",
    "float64",
    "8",
    "4",
    "16",
    "8.0",
    "../../evil",
    "nvcomp",
    "\u0000",
    "\ud800",
    "\u00e9\u4e2d",
    "x" * 65,
    "y" * 129,
    "z" * 5000,
]
JUNK_FLOATS = [0.5, -0.0, 1e308, 1e-320, float("nan"), float("inf"), float("-inf"), 2.0**63]


def junk(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value biased to what breaks validators (wrong types, edge numbers, nesting)."""
    r = rng.random()
    if r < 0.3:
        v = rng.choice(INTERESTING_INTS)
        return v + rng.choice((0, 0, 1, -1)) if isinstance(v, int) else v
    if r < 0.4:
        return rng.choice(JUNK_FLOATS)
    if r < 0.5:
        return rng.choice([True, False, None])
    if r < 0.65:
        return rng.choice(INTERESTING_STRS)
    if r < 0.8 or depth > 3:
        n = rng.choice((0, 0, 1, 2, 5, 1000, 20000)) if depth < 2 else rng.randrange(4)
        kind = rng.random()
        if kind < 0.5:
            return [rng.randrange(-2, 300) for _ in range(n)]
        if kind < 0.7:
            return [{} for _ in range(min(n, 2000))]
        return [junk(rng, depth + 1) for _ in range(min(n, 8))]
    if r < 0.9:
        return {
            rng.choice(INTERESTING_STRS + ["layers", "heads", "mode"]): junk(rng, depth + 1)
            for _ in range(rng.randrange(4))
        }
    v: Any = rng.choice([0, "x", None, {}])
    for _ in range(rng.randrange(1, 60)):
        v = [v] if rng.random() < 0.7 else {"k": v}
    return v


def split_blob(blob: bytes) -> tuple[bytes, bytes] | None:
    """(header JSON bytes, body) of a blob whose prefix is sound enough to locate the header."""
    if len(blob) < PREFIX.size:
        return None
    magic, _ver, _flags, hlen, _crc = PREFIX.unpack_from(blob, 0)
    if magic != MAGIC or PREFIX.size + hlen > len(blob):
        return None
    return blob[PREFIX.size : PREFIX.size + hlen], blob[PREFIX.size + hlen :]


def seal(header: bytes, body: bytes, version: int = 1, flags: int = 0) -> bytes:
    """A container prefix with a *valid* CRC over ``header``."""
    return PREFIX.pack(MAGIC, version, flags, len(header), zlib.crc32(header)) + header + body


def _dump(d: Any, rng: random.Random) -> bytes:
    if rng.random() < 0.85:  # as kvtc writes it; the rest exercises the refusal of other spellings
        return json.dumps(d, separators=(",", ":"), sort_keys=True).encode("utf-8", "surrogatepass")
    compact = rng.random() < 0.7
    return json.dumps(
        d, separators=(",", ":") if compact else None, sort_keys=rng.random() < 0.5, ensure_ascii=rng.random() < 0.8
    ).encode("utf-8", "surrogatepass")


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_paths(v, path + (k,)))
    elif isinstance(node, list) and len(node) <= 64:
        for i, v in enumerate(node):
            out.extend(_paths(v, path + (i,)))
    return out


def _get(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


def mutate_tree(rng: random.Random, d: Any) -> Any:
    """One structural mutation of a parsed header (in place where possible); returns the new root."""
    path = rng.choice(_paths(d))
    if not path:
        return junk(rng) if rng.random() < 0.1 else d
    parent, key = _get(d, path[:-1]), path[-1]
    cur = parent[key]
    op = rng.random()
    if op < 0.35:
        parent[key] = junk(rng)
    elif op < 0.5:
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif op < 0.6 and isinstance(parent, dict):
        parent[rng.choice(INTERESTING_STRS)] = junk(rng)
    elif op < 0.85 and isinstance(cur, int) and not isinstance(cur, bool):
        parent[key] = rng.choice(
            [
                cur + 1,
                cur - 1,
                cur * 2,
                -cur,
                cur + (1 << rng.randrange(64)),
                rng.choice(INTERESTING_INTS),
                str(cur),
                float(cur),
                [cur],
                cur == 0,
            ]
        )
    elif op < 0.85 and isinstance(cur, list):
        r = rng.random()
        if r < 0.3 and cur:
            cur.append(rng.choice(cur))
        elif r < 0.6:
            rng.shuffle(cur)
        elif r < 0.8:
            cur.insert(rng.randrange(len(cur) + 1), junk(rng))
        else:
            parent[key] = {str(i): v for i, v in enumerate(cur)}
    elif op < 0.85 and isinstance(cur, str):
        parent[key] = rng.choice([cur + cur, cur[:-1], cur.upper(), cur * 1000, rng.choice(INTERESTING_STRS), [cur]])
    else:
        parent[key] = rng.choice([None, [], {}, "", 0, True, [cur, cur], {"v": cur}])
    return d


def mutate_json_text(rng: random.Random, h: bytes) -> bytes:
    """Byte/token edits of the header text itself (re-sealed by the caller)."""
    h = bytearray(h)
    r = rng.random()
    pos = rng.randrange(len(h) + 1)
    if r < 0.2 and h:
        h[min(pos, len(h) - 1)] = rng.choice(b'{}[]",:0123456789-+.eEtfn\\ \x00\x80\xff')
    elif r < 0.4:
        tok = rng.choice(
            [
                b"[",
                b"{",
                b"]",
                b"}",
                b",",
                b'"',
                b"\\u",
                b'"\\ud800"',
                b"NaN",
                b"-Infinity",
                b"1e999",
                b"-0",
                b"0" * 5000,
                b"9" * 4400,
                b"\xef\xbb\xbf",
                b"\xff\xfe",
                b"/*x*/",
                b"\t\n",
            ]
        )
        h[pos:pos] = tok
    elif r < 0.55:
        n = rng.choice([10, 100, 900, 990, 1000, 1100, 5000, 100000])
        h[pos:pos] = b"[" * n + b"]" * (n if rng.random() < 0.5 else 0)
    elif r < 0.7 and h:
        a = rng.randrange(len(h))
        del h[a : a + rng.randrange(1, 64)]
    elif r < 0.8:
        enc = rng.choice(["utf-16", "utf-16-le", "utf-32", "latin-1"])
        try:
            return bytes(h).decode("utf-8").encode(enc)
        except (UnicodeError, ValueError):
            return bytes(h)
    elif r < 0.9 and h:
        a = rng.randrange(len(h))
        h[pos:pos] = h[a : a + rng.randrange(1, 256)]
    else:
        h = bytearray(b'{"k":' + bytes(h) + b"}") if rng.random() < 0.5 else h + b" " * rng.randrange(1, 64)
    return bytes(h)


def _fix_body(rng: random.Random, d: Any, body: bytes) -> bytes:
    """Pad or cut ``body`` to the sum of the declared coded sizes (when they are sane) so the header's
    length check passes and the section checks run."""
    try:
        total = sum(int(s[3]) for s in d["sections"])
    except Exception:  # noqa: BLE001 - any malformed table: leave the body alone
        return body
    if not 0 <= total <= len(body) + (1 << 16):
        return body
    return body[:total] + bytes(max(0, total - len(body)))


def rebuild_sections(rng: random.Random, d: dict, lie: bool = True) -> bytes | None:
    """Header ``d`` with sections rebuilt to exactly what the decoder expects (random contents, random
    backend, valid CRCs), so the tensor code runs on the header's values; None when ``d`` is rejected."""
    kv = _load()
    container, KVTCError = kv["container"], kv["KVTCError"]
    try:
        h = container._parse_header(d)
        codec = kv["kvtc_codec"] if h.mode == "kvtc" else kv["identity_codec"]
        exp = codec._expected_sections(h)
    except KVTCError:
        return None
    except Exception:  # noqa: BLE001 - _expected_sections on a header _open would refuse (wrong ratio)
        return None
    if sum(exp.values()) > 1 << 21:
        return None
    secs, bodies = [], []
    fill = rng.random()
    for name, raw in exp.items():
        if fill < 0.4:
            data = rng.randbytes(raw)
        elif fill < 0.6:
            data = bytes(raw)
        elif fill < 0.8:
            data = bytes([rng.choice((0xFF, 0x7F, 0x7C, 0xFC, 0x80))]) * raw  # NaN / inf / -0 patterns
        else:
            data = bytes(rng.randrange(4) for _ in range(raw))
        backend = rng.choice(kv["backends"])
        if backend == "zstd":
            coded = _zstd(data, rng)
        else:
            coded = kv["BACKENDS"][backend].compress(data)
        raw_decl = raw
        if lie and rng.random() < 0.05:
            raw_decl = max(0, raw + rng.choice((-1, 1, raw, 1 << 20)))
        if lie and rng.random() < 0.03:
            backend = rng.choice(INTERESTING_STRS[:12])
        secs.append([name, backend, raw_decl, len(coded), zlib.crc32(coded)])
        bodies.append(coded)
    if lie and rng.random() < 0.05 and secs:
        rng.shuffle(secs)
    d["sections"] = secs
    return seal(_dump(d, rng), b"".join(bodies))


def _zstd(data: bytes, rng: random.Random) -> bytes:
    import zstandard  # listed in BACKENDS only when it imports

    return zstandard.ZstdCompressor(level=1, write_content_size=rng.random() < 0.7).compress(data)


def mutate_fields_deep(rng: random.Random, d: dict) -> dict:
    """Change the slice-level fields (to values the validator may well accept) before a rebuild."""
    for _ in range(rng.randint(1, 3)):
        f = rng.choice(
            [
                "batch",
                "tokens",
                "sinks",
                "window",
                "packing",
                "dtype",
                "heads",
                "mode",
                "ratio",
                "cal",
                "layers",
                "head_dim",
            ]
        )
        lay = d.get("layout") if isinstance(d.get("layout"), dict) else {}
        if f in ("batch", "tokens"):
            d[f] = rng.choice([0, 1, 2, 3, 5, 7, 40, 97, 300])
        elif f in ("sinks", "window"):
            d[f] = rng.choice([0, 1, 2, 4, 5, 39, 40, 41, 128, 1 << 22])
        elif f == "packing":
            d[f] = rng.choice(["bits", "bytes"])
        elif f == "dtype":
            lay["dtype"] = rng.choice(["bfloat16", "float16", "float32"])
        elif f == "heads":
            lay["heads"] = rng.choice([[0], [1], [], [0, 1]])
        elif f == "layers":
            lay["layers"] = rng.choice([[0], [3], [0, 3], [0, 1, 3]])
        elif f == "head_dim":
            lay["head_dim"] = rng.choice([1, 4, 8, 16])
        elif f == "mode":
            if d.get("mode") == "kvtc":
                d.update(mode="identity", calibration=None, ratio=None, sinks=max(d.get("tokens", 0), 0), window=0)
            else:
                cal = _load()["cal"]
                d.update(mode="kvtc", calibration=cal.hash, ratio=rng.choice(["4", "8"]))
        elif f == "ratio":
            d["ratio"] = rng.choice(["4", "8", "16", "8.0", None, "nan"])
        else:
            c = d.get("calibration")
            d["calibration"] = rng.choice([None, "", "0" * 64, (c or "")[:16], c])
    return d


MUTATORS = (
    "random",
    "flip",
    "insert_delete",
    "truncate_extend",
    "splice",
    "prefix_fields",
    "json_text_resealed",
    "json_tree_resealed",
    "sections_resealed",
    "deep_rebuilt",
)
#: mutator weights. ``deep``: a third of the inputs pass the header check and reach the decoders;
#: ``long``: cheaper (most inputs end in the prefix/CRC/JSON checks) for million-input runs
PROFILES = {"deep": (6, 12, 8, 6, 4, 6, 8, 22, 8, 20), "long": (12, 30, 12, 8, 4, 8, 8, 10, 3, 5)}


def _cuts(profile: str) -> list[float]:
    w = PROFILES[profile]
    out, acc = [], 0.0
    for x in w:
        acc += x / sum(w)
        out.append(acc)
    return out


_CUTS = {p: _cuts(p) for p in PROFILES}


def mutate(rng: random.Random, pool: list[bytes], profile: str = "deep") -> tuple[str, bytes]:
    """One fuzz input: (mutator name, bytes)."""
    base = rng.choice(pool)
    r = rng.random()
    c = _CUTS[profile]
    if r < c[0]:
        n = rng.choice((0, 1, 15, 16, 17, 31, 64, rng.randrange(4096)))
        data = rng.randbytes(n)
        if rng.random() < 0.5 and n >= 16:
            data = PREFIX.pack(MAGIC, 1, 0, rng.randrange(16, 4096), rng.getrandbits(32)) + data[16:]
        return "random", data
    if r < c[1]:
        b = bytearray(base)
        parts = split_blob(base)
        # "long": mostly the prefix and header (a flipped body byte only re-tests one section CRC)
        head = PREFIX.size + len(parts[0]) if parts and profile == "long" and rng.random() < 0.8 else len(b)
        for _ in range(rng.choice((1, 1, 2, 4, 16))):
            if b:
                i = rng.randrange(min(head, len(b)))
                b[i] ^= rng.randrange(1, 256) if rng.random() < 0.5 else 1 << rng.randrange(8)
        return "flip", bytes(b)
    if r < c[2]:
        b = bytearray(base)
        i = rng.randrange(len(b) + 1)
        if rng.random() < 0.5:
            b[i:i] = rng.randbytes(rng.choice((1, 2, 4, 8, 64, 1000)))
        else:
            del b[i : i + rng.choice((1, 2, 4, 16, 256))]
        return "insert_delete", bytes(b)
    if r < c[3]:
        if rng.random() < 0.7:
            return "truncate_extend", base[: rng.randrange(len(base) + 1)]
        return "truncate_extend", base + rng.randbytes(rng.choice((1, 4, 100)))
    if r < c[4]:
        other = rng.choice(pool)
        return "splice", base[: rng.randrange(len(base) + 1)] + other[rng.randrange(len(other) + 1) :]
    if r < c[5]:
        b = bytearray(base.ljust(16, b"\x00"))
        fld = rng.randrange(4)
        val = rng.choice(INTERESTING_INTS)
        if fld == 0:
            struct.pack_into("<H", b, 4, val & 0xFFFF)
        elif fld == 1:
            struct.pack_into("<H", b, 6, val & 0xFFFF)
        elif fld == 2:
            struct.pack_into(
                "<I", b, 8, (len(b) - 16 + rng.choice((-1, 0, 1)) if rng.random() < 0.3 else val) & 0xFFFFFFFF
            )
        else:
            struct.pack_into("<I", b, 12, val & 0xFFFFFFFF)
        return "prefix_fields", bytes(b)
    parts = split_blob(base)
    if parts is None:
        return "flip_unsealed", base[:-1]
    hdr, body = parts
    if r < c[6]:
        out = mutate_json_text(rng, hdr)
        return "json_text_resealed", seal(out, body)
    try:
        d = json.loads(hdr)
    except (ValueError, RecursionError):
        return "json_text_resealed", seal(mutate_json_text(rng, hdr), body)
    if r < c[7]:
        for _ in range(rng.choice((1, 1, 2, 3))):
            d = mutate_tree(rng, d)
        try:
            h = _dump(d, rng)
        except (ValueError, RecursionError, UnicodeError):
            return "json_tree_resealed", seal(hdr, body)
        if rng.random() < 0.5:
            body = _fix_body(rng, d, body)
        return "json_tree_resealed", seal(h, body)
    if r < c[8] and isinstance(d, dict) and isinstance(d.get("sections"), list):
        secs = d["sections"]
        for _ in range(rng.choice((1, 2))):
            if not secs:
                break
            s = rng.choice(secs)
            if isinstance(s, list) and len(s) == 5:
                i = rng.choice((2, 2, 3, 3, 4, 1, 0))
                s[i] = rng.choice(
                    [
                        rng.choice(INTERESTING_INTS),
                        s[i] + 1 if isinstance(s[i], int) else s[i],
                        s[i] - 1 if isinstance(s[i], int) else s[i],
                        rng.choice(INTERESTING_STRS),
                    ]
                )
        body = _fix_body(rng, d, body)
        if rng.random() < 0.5:  # re-seal every section CRC over the new cut so the decompressors run
            off = 0
            try:
                for s in secs:
                    s[4] = zlib.crc32(body[off : off + s[3]])
                    off += s[3]
            except Exception:  # noqa: BLE001
                pass
        return "sections_resealed", seal(_dump(d, rng), body)
    if isinstance(d, dict):
        deep = rebuild_sections(rng, mutate_fields_deep(rng, d))
        if deep is not None:
            return "deep_rebuilt", deep
    return "json_tree_resealed", seal(_dump(mutate_tree(rng, d), rng), body)


# ------------------------------------------------------------------------------------------ the loop
@dataclass
class Stats:
    engine: str
    seed: int
    profile: str = "deep"
    all_targets: bool = True
    inputs: int = 0
    header_valid: int = 0
    fully_decoded: int = 0
    results: dict[str, Counter] = field(default_factory=dict)
    errors_by_type: Counter = field(default_factory=Counter)
    mutators: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    failure_examples: list[dict] = field(default_factory=list)
    slowest_s: float = 0.0
    slowest_sha: str = ""
    slowest_mutator: str = ""
    slowest_total_s: float = 0.0
    peak_py: int = 0
    peak_py_header_valid: int = 0
    peak_py_rejected: int = 0
    max_py_frac: float = 0.0
    peak_rss_growth: int = 0
    max_rss_frac: float = 0.0
    t0: float = field(default_factory=time.perf_counter)

    def add(self, mutator: str, data: bytes, out: Outcome | None, fail: FuzzFailure | None) -> None:
        self.inputs += 1
        self.mutators[mutator] += 1
        if fail is not None:
            self.failures[f"{fail.kind}"] += 1
            if len(self.failure_examples) < 20:
                self.failure_examples.append(
                    {
                        "kind": fail.kind,
                        "mutator": mutator,
                        "detail": fail.detail[-4000:],
                        "input_b64": base64.b64encode(data[:65536]).decode(),
                        "input_len": len(data),
                        "sha256": _sha(data),
                    }
                )
            return
        assert out is not None
        for k, v in out.results.items():
            self.results.setdefault(k, Counter())[v] += 1
            if v != "ok":
                self.errors_by_type[v] += 1
        self.header_valid += out.header_valid
        self.fully_decoded += "ok" in (out.results.get("decode_kvtc"), out.results.get("decode_identity"))
        self.slowest_total_s = max(self.slowest_total_s, out.total_seconds)
        if out.seconds > self.slowest_s:
            self.slowest_s, self.slowest_sha, self.slowest_mutator = out.seconds, _sha(data), mutator
        self.peak_py = max(self.peak_py, out.py_peak)
        if out.header_valid:
            self.peak_py_header_valid = max(self.peak_py_header_valid, out.py_peak)
        else:
            self.peak_py_rejected = max(self.peak_py_rejected, out.py_peak)
        self.max_py_frac = max(self.max_py_frac, out.py_peak / out.py_bound)
        if out.rss_growth is not None and out.rss_bound:
            self.peak_rss_growth = max(self.peak_rss_growth, out.rss_growth)
            self.max_rss_frac = max(self.max_rss_frac, out.rss_growth / out.rss_bound)

    def summary(self) -> dict[str, Any]:
        import torch

        import kvtc

        secs = time.perf_counter() - self.t0
        return {
            "target": "kvtc container v1: read_header, Codec.inspect, Codec(cal).decode, Codec(cal).decode_layers, "
            "Codec.identity().decode",
            "engine": self.engine,
            "seed": self.seed,
            "profile": self.profile,
            "all_targets_on_header_rejects": self.all_targets,
            "inputs": self.inputs,
            "seconds": round(secs, 1),
            "inputs_per_s": round(self.inputs / secs, 1) if secs else None,
            "seeds": len(_load()["seeds"]),
            "header_valid_inputs": self.header_valid,
            "decoded_inputs": self.fully_decoded,
            "violations": dict(self.failures),
            "violation_examples": self.failure_examples,
            "unexpected_exceptions": sum(v for k, v in self.failures.items() if k == "exception"),
            "exceptions_by_type": dict(self.errors_by_type.most_common()),
            "results_by_target": {k: dict(v.most_common()) for k, v in self.results.items()},
            "mutators": dict(self.mutators.most_common()),
            "slowest_input_s": round(self.slowest_s, 4),
            "slowest_input_all_entry_points_s": round(self.slowest_total_s, 4),
            "slowest_input": {"sha256": self.slowest_sha, "mutator": self.slowest_mutator},
            "time_limit_s": TIME_LIMIT_S,
            "peak_traced_alloc_bytes": self.peak_py,
            "peak_traced_alloc_rejected_header_bytes": self.peak_py_rejected,
            "peak_traced_alloc_valid_header_bytes": self.peak_py_header_valid,
            "max_traced_alloc_fraction_of_bound": round(self.max_py_frac, 4),
            "peak_rss_growth_bytes": self.peak_rss_growth,
            "max_rss_growth_fraction_of_bound": round(self.max_rss_frac, 4),
            "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "versions": {
                "kvtc": getattr(kvtc, "__version__", "?"),
                "python": platform.python_version(),
                "torch": torch.__version__,
            },
        }


class _Watchdog:
    """Writes out an input that runs past ``HANG_S`` and ends the process (a real hang never returns)."""

    def __init__(self, crash_dir: Path | None):
        self.current: tuple[float, bytes] | None = None
        self.crash_dir = crash_dir
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            cur = self.current
            if cur is not None and time.perf_counter() - cur[0] > HANG_S:
                data = cur[1]
                msg = {
                    "hang": True,
                    "seconds": HANG_S,
                    "sha256": _sha(data),
                    "input_b64": base64.b64encode(data[:65536]).decode(),
                }
                if self.crash_dir:
                    self.crash_dir.mkdir(parents=True, exist_ok=True)
                    (self.crash_dir / f"hang-{_sha(data)[:16]}").write_bytes(data)
                print(json.dumps(msg), flush=True)
                os._exit(70)


def run_loop(
    runs: int | None,
    seconds: float | None,
    seed: int = 0,
    crash_dir: Path | None = None,
    progress: Callable[[Stats], None] | None = None,
    watchdog: bool = False,
    profile: str = "deep",
    all_targets: bool = True,
) -> Stats:
    """The plain mutation loop: ``runs`` inputs or ``seconds`` of fuzzing, whichever ends first."""
    kv = _load()
    rng = random.Random(seed)
    pool = list(kv["seeds"])
    stats = Stats("loop", seed, profile=profile, all_targets=all_targets)
    wd = _Watchdog(crash_dir) if watchdog else None
    tracemalloc.start(1)
    deadline = time.perf_counter() + seconds if seconds else None
    try:
        while (runs is None or stats.inputs < runs) and (deadline is None or time.perf_counter() < deadline):
            mname, data = mutate(rng, pool, profile)
            if wd:
                wd.current = (time.perf_counter(), data)
            out = fail = None
            try:
                out = check_input(data, all_targets=all_targets)
            except FuzzFailure as f:
                fail = f
                if crash_dir:
                    crash_dir.mkdir(parents=True, exist_ok=True)
                    (crash_dir / f"{f.kind}-{_sha(data)[:16]}").write_bytes(data)
            if wd:
                wd.current = None
            stats.add(mname, data, out, fail)
            # keep a few inputs that got past the header check: later mutations start deeper
            if out is not None and out.header_valid and len(data) < 65536 and rng.random() < 0.02:
                if len(pool) < 512:
                    pool.append(data)
                else:
                    pool[rng.randrange(len(kv["seeds"]), len(pool))] = data
            if progress and stats.inputs % 10000 == 0:
                progress(stats)
    finally:
        tracemalloc.stop()
    return stats


def run_atheris(argv_rest: list[str], runs: int | None, seconds: float | None, seed: int, out: Path | None) -> None:
    import atheris

    kv = _load(instrument=True)
    stats = Stats("atheris", seed)
    deadline = time.perf_counter() + seconds if seconds else None
    tracemalloc.start(1)

    def finish() -> None:
        s = stats.summary()
        text = json.dumps(s, indent=1)
        print(text, flush=True)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text + "\n")
        os._exit(1 if stats.failures else 0)

    def target(data: bytes) -> None:
        data = bytes(data)
        try:
            o = check_input(data)
            stats.add("atheris", data, o, None)
        except FuzzFailure as f:
            stats.add("atheris", data, None, f)
            raise
        if (runs is not None and stats.inputs >= runs) or (deadline is not None and time.perf_counter() > deadline):
            finish()

    def custom_mutator(data: bytes, max_size: int, seed_: int) -> bytes:
        rng = random.Random(seed_)
        if rng.random() < 0.3 or not data:
            return atheris.Mutate(data, max_size)
        _, m = mutate(rng, [bytes(data)] + kv["seeds"][:2])
        return m[:max_size]

    argv = [sys.argv[0], *argv_rest, "-rss_limit_mb=4096", "-timeout=20"]
    atheris.Setup(argv, target, custom_mutator=custom_mutator)
    atheris.Fuzz()


def _limit_memory(extra_mb: int) -> None:
    """Cap the address space a little above what is mapped now: a runaway allocation becomes a
    MemoryError (reported as a violation) instead of swapping the machine."""
    try:
        with open("/proc/self/status") as f:
            vm = int(re.search(r"VmSize:\s+(\d+) kB", f.read()).group(1)) * 1024  # type: ignore[union-attr]
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = vm + (extra_mb << 20)
        if hard == resource.RLIM_INFINITY or want <= hard:
            resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    import torch

    torch.set_num_threads(1)  # tiny tensors: threads only add overhead (the CLI only; tests keep theirs)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=None, help="number of inputs")
    ap.add_argument("--seconds", type=float, default=None, help="time budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--engine",
        choices=("auto", "loop", "atheris"),
        default="loop",
        help="loop: plain mutation loop; atheris: coverage-guided (with the same mutators); "
        "auto: atheris when it imports",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    ap.add_argument("--crash-dir", type=Path, default=None, help="write violating inputs here")
    ap.add_argument("--mem-limit-mb", type=int, default=3072, help="address-space headroom (0: no cap)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="deep", help="mutator weights")
    ap.add_argument(
        "--fast",
        action="store_true",
        help="skip the other targets when read_header rejects an input (they all start with it)",
    )
    ap.add_argument("--quiet", action="store_true")
    args, rest = ap.parse_known_args(argv)
    if args.runs is None and args.seconds is None:
        args.runs = 10000
    engine = args.engine
    if engine == "auto":
        try:
            import atheris  # noqa: F401

            engine = "atheris"
        except ImportError:
            engine = "loop"
    _load(instrument=engine == "atheris")
    if args.mem_limit_mb:
        _limit_memory(args.mem_limit_mb)
    if engine == "atheris":
        if args.crash_dir:
            rest.append(f"-artifact_prefix={args.crash_dir}/")
        run_atheris(rest, args.runs, args.seconds, args.seed, args.out)
        return 0  # not reached: atheris ends the process

    def progress(s: Stats) -> None:
        if not args.quiet and s.inputs % 100000 == 0:
            el = time.perf_counter() - s.t0
            print(
                f"# {s.inputs} inputs, {s.inputs / el:.0f}/s, violations {dict(s.failures)}, "
                f"slowest {s.slowest_s * 1e3:.1f} ms",
                file=sys.stderr,
                flush=True,
            )

    stats = run_loop(
        args.runs,
        args.seconds,
        args.seed,
        args.crash_dir,
        progress,
        watchdog=True,
        profile=args.profile,
        all_targets=not args.fast,
    )
    s = stats.summary()
    text = json.dumps(s, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
