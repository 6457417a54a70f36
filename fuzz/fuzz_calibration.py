"""Hostile calibration files: a seeded mutation loop over ``Calibration.from_bytes`` and ``Calibration.load``.

Seeds: the checked-in fixture calibration, one fitted here with sensitivity feature scales (so the
``scale`` tensors are present) and a rich one (below). Each input is one of them
mutated

* at the metadata level: a field replaced by random JSON of a random type, fields removed or added, integer
  and list edits, deep nesting (up to 200,000 levels), NaN / Infinity / 1e999 / 5,000-digit numbers, huge
  counts (a million layers, 2**40 heads, a segment repeated 10**15 times), edits of the JSON text itself;
* in the safetensors tensor table: dtypes, shapes and data offsets changed, entries removed or duplicated;
* in the safetensors metadata itself (which safetensors defines as an object of strings): the ``kvtc`` entry or
  an extra one made a number (up to 10**15, or an integer of up to 300,000 digits), null, a list, an object,
  NaN, or a string of megabytes; ``__metadata__`` made a non-object; more entries than a calibration may hold;
* huge integers (25 to 300,000 digits) in any metadata field or in the tensor table;
* in the tensors' values: a zero, negative, denormal, infinite or NaN value written into a tensor a decode
  divides by or multiplies in (scales, standard deviations, eigenvalues, means, bases, queries, token map),
  either in the bytes (the checksum then fails too) or forged (the hash and checksum recomputed, so only the value
  is wrong);
* at the byte level: bit flips, truncations, insertions, a wrong header length, random bytes.

The rich seed adds mean queries, their map and a token map: every kind of tensor a calibration holds.

Properties per input: only :class:`kvtc.errors.CalibrationError` escapes (from the bytes, and from a file
written to a temp dir), each call returns within ``TIME_LIMIT_S``, and the process's peak RSS grows by less
than ``RSS_BASE`` plus a small multiple of the input's size.

    python fuzz/fuzz_calibration.py --runs 20000 --seed 1 --out cal.json
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import Tally, campaign_args, hwm, reset_hwm, write_summary  # noqa: E402
from fuzz_container import INTERESTING_INTS, _get, _paths, junk, mutate_json_text, mutate_tree  # noqa: E402

FIXTURE = HERE.parent / "tests" / "fixtures" / "calibration.safetensors"
TIME_LIMIT_S = 1.0
HANG_S = 20.0
RSS_BASE = 64 << 20
RSS_PER_INPUT_BYTE = 64
BAD_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000, "-0", "1e-400", "18446744073709551616"]


def build_seeds() -> dict[str, bytes]:
    """The fixture, and a calibration with sensitivity scales (fitted in ~0.2 s on synthetic rows)."""
    import torch

    from kvtc import KVLayout
    from kvtc.calibration import Recipe, fit_calibration

    seeds = {"fixture": FIXTURE.read_bytes()}
    layout = KVLayout(layers=(0, 3), num_kv_heads=2, head_dim=8, dtype="bfloat16")
    g = torch.Generator().manual_seed(99)
    p = layout.num_features
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
    sd = torch.logspace(0.5, -2, p)

    def rows(n: int) -> torch.Tensor:
        return (torch.randn(n, p, generator=g) * sd) @ q.T + 0.5

    scales = {"keys": torch.rand(p, generator=g) + 0.5, "values": torch.rand(p, generator=g) + 0.5}
    cal = fit_calibration(
        layout,
        [(rows(384), rows(384) * 0.3)],
        Recipe(ratios=(4, 8, 16), dp_rows=192),
        model_id="fuzz-scaled",
        corpus={"name": "synthetic"},
        feature_scale=scales,
    )
    # timings would make the seed (and so every mutation) differ per run
    cal = dataclasses.replace(cal, stats={"seconds": {"total": 0.0}})
    seeds["scaled"] = cal.to_bytes()
    seeds["rich"] = rich_seed(cal, g).to_bytes()
    return seeds


def rich_seed(cal: Any, g: Any) -> Any:
    """``cal`` with mean queries, their key-to-query map and a token map."""
    import torch

    from kvtc.calibration.token_map import LAGS, PROBE_ROWS, TokenMap

    lay = cal.layout
    f, p, emb, vocab, groups = LAGS * 4, lay.num_features, 4, 64, 2
    tm = TokenMap.from_weights(
        LAGS,
        vocab,
        torch.randn(f, generator=g),
        torch.rand(f, generator=g) + 0.1,
        {k: (torch.randn(f, p, generator=g) * 0.05).half() for k in ("keys", "values")},
        torch.randn(PROBE_ROWS, emb, generator=g),
    )
    n, heads, d = len(lay.layers), len(lay.heads), lay.head_dim
    return dataclasses.replace(
        cal,
        queries=torch.randn(n, heads, groups, d, generator=g),
        query_scales=torch.full((n,), d**-0.5),
        query_map=torch.randn(n, heads, d + 1, groups * d, generator=g) * 0.1,
        token_map=tm,
    )


# ------------------------------------------------------------------------------------------ the file's parts
def split(data: bytes) -> tuple[dict, dict, bytes]:
    """(safetensors header without metadata, kvtc metadata, tensor bytes) of a well-formed seed."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header.pop("__metadata__")["kvtc"])
    return header, meta, data[8 + n :]


def join(header: Any, meta_text: str, body: bytes) -> bytes:
    h = dict(header) if isinstance(header, dict) else {"junk": header}
    h["__metadata__"] = {"kvtc": meta_text}
    raw = json.dumps(h, allow_nan=True).encode("utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _dump(meta: Any) -> str:
    return json.dumps(meta, allow_nan=True)


def join_raw(header: dict, metadata_text: str, body: bytes) -> bytes:
    """Like :func:`join`, with ``__metadata__`` given as raw JSON text (numbers no Python int is built for)."""
    h = dict(header)
    h["__metadata__"] = "@@METADATA@@"
    raw = json.dumps(h).replace('"@@METADATA@@"', metadata_text, 1).encode("utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


# ------------------------------------------------------------------------------------------ mutators
def _replace_text(meta: Any, rng: random.Random, token: str) -> str:
    """Meta text with one field (at a random path) replaced by raw JSON text ``token``."""
    meta = copy.deepcopy(meta)
    paths = [p for p in _paths(meta) if p]
    path = rng.choice(paths)
    _get(meta, path[:-1])[path[-1]] = "@@FUZZ@@"
    return _dump(meta).replace('"@@FUZZ@@"', token, 1)


def m_field_junk(rng, header, meta, body):
    meta = copy.deepcopy(meta)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        meta = mutate_tree(rng, meta)
    return join(header, _dump(meta), body)


def m_deep(rng, header, meta, body):
    depth = rng.choice((33, 100, 999, 1000, 5000, 50_000, 200_000))
    opener, closer = ("[", "]") if rng.random() < 0.6 else ('{"a":', "}")
    return join(header, _replace_text(meta, rng, opener * depth + "0" + closer * depth), body)


def m_numbers(rng, header, meta, body):
    return join(header, _replace_text(meta, rng, rng.choice(BAD_NUMBERS)), body)


def m_counts(rng, header, meta, body):
    meta = copy.deepcopy(meta)
    r = rng.random()
    n = rng.choice((0, 1, 4097, 100_000, 1_000_000))
    if r < 0.3:
        meta["layout"][rng.choice(("layers", "heads"))] = list(range(n))
    elif r < 0.5:
        meta["layout"][rng.choice(("num_kv_heads", "head_dim"))] = rng.choice(INTERESTING_INTS)
    elif r < 0.7 and isinstance(meta.get("plans"), dict) and meta["plans"]:
        key = rng.choice(sorted(meta["plans"]))
        kind = rng.choice(("keys", "values"))
        segs = meta["plans"][key][kind][0].get("segments")
        if isinstance(segs, list) and segs:
            seg = list(rng.choice(segs))
            seg[rng.randrange(len(seg))] = rng.choice(INTERESTING_INTS)
            if rng.random() < 0.5:
                segs.extend([seg] * n)
            else:
                segs[rng.randrange(len(segs))] = seg
    elif r < 0.85:
        kind = rng.choice(("keys", "values"))
        pcas = meta["pca"][kind]
        pcas.extend(copy.deepcopy(pcas[:1]) * min(n, 5000))
    else:
        meta["plans"] = {f"{i}.0": meta["plans"][next(iter(meta["plans"]))] for i in range(min(n, 2000))}
    return join(header, _dump(meta), body)


def m_meta_text(rng, header, meta, body):
    text = _dump(meta).encode()
    for _ in range(rng.choice((1, 1, 2, 4))):
        text = mutate_json_text(rng, text)
    return join(header, text.decode("utf-8", "replace"), body)


def m_tensor_table(rng, header, meta, body):
    header = copy.deepcopy(header)
    names = sorted(header)
    name = rng.choice(names)
    entry = header[name]
    r = rng.random()
    if r < 0.25:
        entry["dtype"] = rng.choice(["F32", "F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "X", 3])
    elif r < 0.5:
        entry["shape"] = rng.choice(
            [[], [0], [1 << 40], [-1], [3, 3], list(reversed(entry["shape"])), entry["shape"] + [1], [len(body)]]
        )
    elif r < 0.7:
        a, b = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[b, a], [a, a], [0, len(body) + 8], [a, b + 4], [a - 4, b], [0, 1 << 62]])
    elif r < 0.8:
        del header[name]
    elif r < 0.9:
        header[name + "x"] = entry
    else:
        header = mutate_tree(rng, header)
    return join(header, _dump(meta), body)


def _huge_int(rng: random.Random) -> str:
    return "-" * (rng.random() < 0.3) + "9" * rng.choice((21, 25, 100, 4300, 4301, 100_000, 300_000))


def _not_a_string(rng: random.Random) -> str:
    """JSON text of a value safetensors metadata may not hold (it holds strings)."""
    return rng.choice(
        [
            lambda: str(rng.choice((0, 1, -1, 8, 1 << 20, 10**8, 10**12, 10**15))),
            lambda: _huge_int(rng),
            lambda: rng.choice(("null", "true", "false", "[]", "{}", "[1, 2]", '{"a": 1}', '["x"]')),
            lambda: rng.choice(("NaN", "Infinity", "-Infinity", "1e999", "0.5", "-0.0", "1e-400")),
            lambda: json.dumps(junk(rng)),
        ]
    )()


def m_header_metadata(rng, header, meta, body):
    """The safetensors metadata made what safetensors does not allow (non-strings) or too large."""
    kvtc = json.dumps(_dump(meta))
    r = rng.random()
    if r < 0.35:
        text = '{"kvtc": ' + _not_a_string(rng) + "}"
    elif r < 0.6:
        text = (
            '{"kvtc": ' + kvtc + ", " + json.dumps(rng.choice(("other", "", "kvtc2"))) + ": " + _not_a_string(rng) + "}"
        )
    elif r < 0.75:
        text = _not_a_string(rng)  # __metadata__ itself not an object
    elif r < 0.85:
        n = rng.choice((65, 200, 5000))
        text = '{"kvtc": ' + kvtc + "".join(f', "k{i}": "v"' for i in range(n)) + "}"
    else:
        junk_text = json.dumps("x" * rng.choice((1 << 16, 1 << 20, 4 << 20)))
        text = '{"kvtc": ' + (junk_text if rng.random() < 0.5 else kvtc + ', "other": ' + junk_text) + "}"
    return join_raw(header, text, body)


def m_huge_ints(rng, header, meta, body):
    """An integer of many digits in a metadata field or in the tensor table."""
    if rng.random() < 0.7:
        return join(header, _replace_text(meta, rng, _huge_int(rng)), body)
    h = copy.deepcopy(header)
    entry = h[rng.choice(sorted(h))]
    field_name = rng.choice(("shape", "data_offsets"))
    if isinstance(entry.get(field_name), list) and entry[field_name]:
        entry[field_name][rng.randrange(len(entry[field_name]))] = "@@INT@@"
    return _join_text(json.dumps(h).replace('"@@INT@@"', _huge_int(rng), 1), meta, body)


def _join_text(header_text: str, meta: Any, body: bytes) -> bytes:
    """A file of a raw header text (a JSON object without ``__metadata__``) and the kvtc metadata."""
    text = header_text.rstrip()
    sep = ", " if text != "{}" else ""
    raw = (text[:-1] + sep + '"__metadata__": ' + json.dumps({"kvtc": _dump(meta)}) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


#: values no decode can use, in any float tensor (the ones a check must refuse depend on the tensor)
BAD_VALUES = [0.0, -0.0, -1.0, 1e-40, 1e-45, 1.1754942e-38, 5e-7, float("inf"), float("-inf"), float("nan"), 3.4e38]
_PACK = {"F32": "<f", "F16": "<e"}


def m_tensor_bytes(rng, header, meta, body):
    """A bad value written into a tensor's bytes (the checksum no longer matches either)."""
    name = rng.choice(sorted(header))
    entry = header[name]
    fmt = _PACK.get(entry.get("dtype"))
    a, b = entry["data_offsets"]
    if fmt is None or b <= a:
        return join(header, _dump(meta), body)
    width = struct.calcsize(fmt)
    i = a + width * rng.randrange((b - a) // width)
    value = rng.choice(BAD_VALUES)
    try:
        packed = struct.pack(fmt, value)
    except (OverflowError, struct.error):
        packed = struct.pack(fmt, float("inf"))
    return join(header, _dump(meta), body[:i] + packed + body[i + width :])


def m_tensor_forged(rng, header, meta, body):
    """A bad value written into a tensor of the calibration, its hash and checksum recomputed (as a forger would):
    only the value is wrong."""
    from kvtc.calibration import Calibration

    cal = Calibration.from_bytes(join(header, _dump(meta), body))
    # the int8 weights of the maps hold only finite values: their scales (or the map they come from) are forged
    name = rng.choice(sorted(n for n, t in cal._tensors().items() if t.is_floating_point()))
    target = _live_tensor(cal, name)
    flat = target.view(-1)
    if flat.numel():
        flat[rng.randrange(flat.numel())] = rng.choice(BAD_VALUES)
    cal.hash = cal._compute_hash()
    return cal.to_bytes()


def _live_tensor(cal: Any, name: str) -> Any:
    """The tensor of ``cal`` a file's tensor ``name`` is written from (not a copy)."""
    if name == "queries":
        return cal.queries
    if name == "queries.scale":
        return cal.query_scales
    if name.startswith("queries.map"):  # the file's parts of the map are written from the whole map
        return cal.query_map
    if name.startswith("tokens."):
        part = name.split(".", 1)[1]
        tm = cal.token_map
        if part.endswith(".scale"):
            return tm.scales[part.removesuffix(".scale")]
        return tm.weights[part] if part in ("keys", "values") else getattr(tm, part)
    kind, g, part = name.split(".")
    return getattr(cal.pcas[kind][int(g)], part)


def m_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    r = rng.random()
    if r < 0.3:
        for _ in range(rng.choice((1, 1, 2, 8))):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif r < 0.55:
        b = b[: rng.randrange(len(b))]
    elif r < 0.7:
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.choice((1, 7, 64)))
    elif r < 0.85:
        b[:8] = struct.pack(
            "<Q",
            rng.choice(
                [
                    0,
                    1,
                    7,
                    len(b),
                    len(b) - 8,
                    1 << 40,
                    (1 << 64) - 1,
                    int.from_bytes(b[:8], "little") + rng.choice((-8, -1, 1, 8)),
                ]
            ),
        )
    else:
        i = rng.randrange(len(b))
        j = rng.randrange(i, min(len(b), i + 4096) + 1)
        del b[i:j]
    return bytes(b)


META_MUTATORS = {
    "field_junk": (m_field_junk, 30),
    "deep_nesting": (m_deep, 6),
    "bad_numbers": (m_numbers, 10),
    "huge_counts": (m_counts, 8),
    "meta_text": (m_meta_text, 12),
    "tensor_table": (m_tensor_table, 10),
    "header_metadata": (m_header_metadata, 10),
    "huge_ints": (m_huge_ints, 6),
    "tensor_bytes": (m_tensor_bytes, 6),
    "tensor_forged": (m_tensor_forged, 10),
}


def mutate(rng: random.Random, seeds: dict[str, bytes]) -> tuple[str, bytes]:
    name = rng.choice(sorted(seeds))
    data = seeds[name]
    r = rng.random()
    if r < 0.02:
        return "random_bytes", rng.randbytes(rng.choice((0, 7, 8, 64, 4096)))
    if r < 0.02 + 0.22:
        return "bytes", m_bytes(rng, data)
    header, meta, body = split(data)
    names = sorted(META_MUTATORS)
    fn_name = rng.choices(names, weights=[META_MUTATORS[n][1] for n in names])[0]
    out = META_MUTATORS[fn_name][0](rng, header, meta, body)
    if rng.random() < 0.05:
        out = m_bytes(rng, out)
    return fn_name, out


# ------------------------------------------------------------------------------------------ checks
def check(data: bytes, tmp: Path) -> tuple[str, float, int | None, tuple[str, str] | None]:
    """(outcome, slowest seconds, RSS growth, violation or None) of one input through both entry points."""
    from kvtc.calibration import Calibration
    from kvtc.errors import CalibrationError

    path = tmp / "cal.safetensors"
    path.write_bytes(data)
    base = reset_hwm()
    outcomes = []
    slowest = 0.0
    violation = None
    for name, fn in (("from_bytes", lambda: Calibration.from_bytes(data)), ("load", lambda: Calibration.load(path))):
        t0 = time.perf_counter()
        try:
            fn()
            outcomes.append("ok")
        except CalibrationError:
            outcomes.append("CalibrationError")
        except Exception as e:  # noqa: BLE001 - the property under test
            outcomes.append(type(e).__name__)
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            violation = violation or ("exception", f"{name}: {type(e).__name__}: {e}\n{tb}")
        dt = time.perf_counter() - t0
        slowest = max(slowest, dt)
        if dt > TIME_LIMIT_S and violation is None:
            violation = ("slow", f"{name}: {dt:.3f} s > {TIME_LIMIT_S} s")
    growth = hwm() - base if base is not None else None
    if growth is not None and growth > RSS_BASE + RSS_PER_INPUT_BYTE * len(data) and violation is None:
        violation = ("memory", f"peak RSS grew {growth} B (bound {RSS_BASE + RSS_PER_INPUT_BYTE * len(data)} B)")
    outcome = outcomes[0] if outcomes[0] == outcomes[1] else "/".join(outcomes)
    return outcome, slowest, growth, violation


def run(runs: int, seed: int, seconds: float | None = None) -> Tally:
    import base64
    import hashlib

    from fuzz_container import _Watchdog

    seeds = build_seeds()
    rng = random.Random(seed)
    tally = Tally("calibration", seed)
    tally.extra["seeds"] = sorted(seeds)
    wd = _Watchdog(None)  # an input still running after fuzz_container.HANG_S (20 s) ends the process
    deadline = time.perf_counter() + seconds if seconds else None
    with tempfile.TemporaryDirectory(prefix="kvtc-fuzz-cal-") as d:
        tmp = Path(d)
        for name, data in seeds.items():  # the unmutated seeds must load
            outcome, dt, growth, violation = check(data, tmp)
            if outcome != "ok":
                violation = violation or ("seed_rejected", f"seed {name}: {outcome}")
            tally.add("seed", name, outcome, dt, name, violation, growth)
        while tally.inputs < runs and (deadline is None or time.perf_counter() < deadline):
            mname, data = mutate(rng, seeds)
            wd.current = (time.perf_counter(), data)
            outcome, dt, growth, violation = check(data, tmp)
            wd.current = None
            what = f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}"
            if violation is not None:
                what += " b64:" + base64.b64encode(data[:1500]).decode()
            tally.add("file", mname, outcome, dt, what, violation, growth)
    return tally


TARGET = "Calibration.from_bytes and Calibration.load (a temp file)"


def main(argv: list[str] | None = None) -> int:
    import torch

    torch.set_num_threads(1)
    args = campaign_args(
        __doc__, 2000, argv, lambda ap: ap.add_argument("--seconds", type=float, default=None, help="time budget")
    )
    tally = run(args.runs, args.seed, args.seconds)
    print(write_summary(tally.summary(TARGET, TIME_LIMIT_S, HANG_S), args.out))
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
