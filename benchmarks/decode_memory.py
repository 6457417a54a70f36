"""Peak resident memory of a CPU decode against the decoded KV bytes it declares, for every decode mode.

    python benchmarks/decode_memory.py [--sizes 64,256,1024] [--modes plan,ladder] [--no-benchmarks-md]
                                       [--baseline REV]

The bound (security issue "Hostile input, round 2", acceptance line 3): the peak resident memory a decode adds is at
most 1.5 x its decoded KV bytes (``2 x batch x tokens x features x dtype size``,
:func:`kvtc.codec.budget.decoded_output_bytes`) + 64 MiB, so that ``max_decoded_bytes`` bounds what a decode takes.

Each case encodes a synthetic slice in this process (a low-rank KV of 16 layers x 2 KV heads x 64, bf16, two
sequences; a calibration fitted on the same sources, with mean queries and RoPE so that two tiers and the rate ladder
apply; a token map of 3 lags over 192-wide embeddings), writes the blob, the calibration and the embeddings to a
temporary folder, and decodes it in a fresh subprocess: the codec and the blob are loaded, then VmRSS is read from
/proc/self/status, the peak is reset (``5`` into /proc/self/clear_refs), the decode runs (its result kept alive:
``decode_layers`` keeps every layer it yields) and VmHWM is read. Peak extra = VmHWM - VmRSS before.

Modes: ``identity`` (raw tokens, no calibration); ``plan`` (one plan at 16x, zstd with the Gaussians), ``plan-huff4k``
(the same under huff4k, decoded by its CPU twin); ``tiers`` (two tiers, 8x / 32x); ``ladder`` (the rate ladder, 8x-32x);
``token-map`` (one plan, each middle token coded less its token-map prediction); ``sliding`` and ``sliding-ladder``
(a layout whose layers are, five in six, sliding-window layers of 1,024 tokens); ``layers``, ``layers-sliding-ladder``
and ``layers-token-map`` (:meth:`Codec.decode_layers` of the blobs of ``plan``, ``sliding-ladder`` and ``token-map``).

``--baseline REV``: each blob is also decoded by the kvtc of that git revision of this repository (its ``src``, taken
with ``git archive`` into a temporary folder; e.g. the commit before a change), in its own fresh process: the table
gets "before" columns.

Writes benchmarks/results/decode_memory.json and the "decode_memory" section of BENCHMARKS.md (not with
``--no-benchmarks-md``), and prints the section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS, ROOT, command, machine, table, update_section, write_json  # noqa: E402

MIB = 1 << 20
#: the bound: peak extra <= FACTOR x decoded KV bytes + SLACK
FACTOR, SLACK = 1.5, 64 * MIB
LAYERS, HEADS, HEAD_DIM, BATCH = 16, 2, 64, 2
RANK = 256
RATIO = 16
RATIOS = (8, 16, 32)
#: sliding-window layers (five in six) hold this many tokens
WINDOW = 1024
VOCAB, EMB_DIM = 8192, 192
#: mode -> (layout, codec settings, decode_layers)
MODES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "identity": ("dense", {"identity": True}, False),
    "plan": ("dense", {"tiers": "none"}, False),
    "plan-huff4k": ("dense", {"tiers": "none", "backend": "huff4k"}, False),
    "tiers": ("dense", {"tiers": (8, 32)}, False),
    "ladder": ("dense", {"tiers": "auto"}, False),
    "token-map": ("dense", {"tiers": "none", "token_map": True}, False),
    "sliding": ("sliding", {"tiers": "none"}, False),
    "sliding-ladder": ("sliding", {"tiers": "auto"}, False),
    "layers": ("dense", {"tiers": "none"}, True),
    "layers-sliding-ladder": ("sliding", {"tiers": "auto"}, True),
    "layers-token-map": ("dense", {"tiers": "none", "token_map": True}, True),
}


# ---------------------------------------------------------------------------------------------- the child
def _status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def measure(folder: Path, layers: bool) -> dict[str, Any]:
    """Decode ``folder``'s blob (``decode_layers`` when ``layers``) and return its peak extra resident bytes."""
    from safetensors.torch import load_file

    from kvtc.calibration import Calibration
    from kvtc.codec import Codec, budget, container

    meta = json.loads((folder / "codec.json").read_text())
    if meta.get("identity"):
        codec = Codec.identity()
    else:
        emb = None
        if (folder / "embeddings.safetensors").exists():
            emb = load_file(str(folder / "embeddings.safetensors"))["weight"]
        cal = Calibration.load(folder / "calibration.safetensors")
        codec = Codec(cal, RATIO, embeddings=emb)
    blob = (folder / "blob.kvtc").read_bytes()
    header, _ = container.read_header(blob)
    decoded = budget.decoded_output_bytes(header)
    before = _status()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    out = list(codec.decode_layers(blob)) if layers else codec.decode(blob)
    seconds = time.perf_counter() - t0
    peak = _status()["VmHWM"]
    del out
    return {"decoded_bytes": decoded, "peak_extra_bytes": peak - before, "seconds": seconds}


def measure_in_child(folder: Path, layers: bool, threads: int | None = None, src: str | None = None) -> dict[str, Any]:
    """:func:`measure` in a fresh interpreter (``src``: the kvtc source folder it imports, default this checkout's)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(folder)] + (["--layers"] if layers else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = src or str(ROOT / "src")
    if threads:
        env["KVTC_BENCH_THREADS"] = str(threads)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode:
        raise RuntimeError(f"decode subprocess failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------- the parent
class Source:
    """Rows ``µ + z Qᵀ + noise`` with z's standard deviations decaying geometrically (a KV-like spectrum)."""

    def __init__(self, p: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.q, _ = torch.linalg.qr(torch.randn(p, RANK, generator=g))
        self.sd = torch.logspace(1, -2, RANK)
        self.mu = torch.randn(p, generator=g)
        self.gen = torch.Generator().manual_seed(seed + 100)

    def rows(self, n: int) -> torch.Tensor:
        z = torch.randn(n, RANK, generator=self.gen) * self.sd
        return self.mu + z @ self.q.T + 0.01 * torch.randn(n, self.q.shape[0], generator=self.gen)


def layout_of(name: str):
    from kvtc import KVLayout

    max_tokens = tuple(0 if i % 6 == 5 else WINDOW for i in range(LAYERS)) if name == "sliding" else ()
    return KVLayout(tuple(range(LAYERS)), HEADS, HEAD_DIM, dtype="bfloat16", max_tokens=max_tokens)


def rope_dict(layout) -> dict[str, Any]:
    from kvtc.rope import RopeKind, RopeSpec

    inv = tuple(float(torch.tensor(10000 ** (-2 * i / HEAD_DIM), dtype=torch.float32)) for i in range(HEAD_DIM // 2))
    return RopeSpec(HEAD_DIM, False, (RopeKind("full", "default", inv),), ("full",) * LAYERS).to_dict()


def calibration(name: str):
    """The layout's calibration (plans at 8x, 16x and 32x, mean queries), cached under KVTC_CACHE."""
    from kvtc.calibration import Calibration, Recipe, fit_calibration

    cache = Path(os.environ["KVTC_CACHE"]) / "bench_decode_memory"
    path = cache / f"{name}-{LAYERS}x{HEADS}x{HEAD_DIM}-r{RANK}.safetensors"
    if path.exists():
        return Calibration.load(path)
    layout = layout_of(name)
    p = layout.num_features
    ks, vs = Source(p, 1), Source(p, 2)
    rows = [(ks.rows(4096), vs.rows(4096) * 0.5) for _ in range(2)]
    cal = fit_calibration(layout, rows, Recipe(ratios=RATIOS, dp_rows=1024), rope=rope_dict(layout))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(LAYERS, HEADS, 2, HEAD_DIM, generator=g)
    cal = dataclasses.replace(cal, queries=q, query_scales=torch.full((LAYERS,), HEAD_DIM**-0.5))
    cache.mkdir(parents=True, exist_ok=True)
    cal.save(path)
    return Calibration.load(path)


def token_map(cal, seed: int = 7):
    """A token map of 3 lags over random embeddings and its embedding table."""
    from kvtc.calibration.token_map import LAGS, TokenMap, probe_ids

    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(VOCAB, EMB_DIM, generator=g)
    f, p = LAGS * EMB_DIM, cal.layout.num_features
    weights = {k: (torch.randn(f, p, generator=g) * 0.05).half() for k in ("keys", "values")}
    tm = TokenMap.from_weights(LAGS, VOCAB, torch.zeros(f), torch.ones(f), weights, emb[probe_ids(VOCAB)])
    return dataclasses.replace(cal, token_map=tm), emb


def make_slice(name: str, tokens: int, seed: int = 5):
    """A ``[BATCH, tokens]`` bf16 slice of the layout (a sliding layer's tokens older than it holds are zero) and
    random token ids."""
    from kvtc import KVSlice

    layout = layout_of(name)
    p = layout.num_features
    ks, vs = Source(p, 1), Source(p, 2)
    shape = (BATCH, tokens, LAYERS, HEADS, HEAD_DIM)
    keys = torch.empty(shape, dtype=torch.bfloat16)
    values = torch.empty(shape, dtype=torch.bfloat16)
    step = 8192
    for b in range(BATCH):
        for t in range(0, tokens, step):
            n = min(step, tokens - t)
            keys[b, t : t + n] = ks.rows(n).view(n, LAYERS, HEADS, HEAD_DIM).bfloat16()
            values[b, t : t + n] = (vs.rows(n) * 0.5).view(n, LAYERS, HEADS, HEAD_DIM).bfloat16()
    for i in range(LAYERS):
        held = layout.held(i, tokens)
        keys[:, : tokens - held, i] = 0
        values[:, : tokens - held, i] = 0
    ids = torch.randint(0, VOCAB, (BATCH, tokens), generator=torch.Generator().manual_seed(seed))
    return KVSlice(layout, keys, values, torch.arange(seed, seed + tokens).repeat(BATCH, 1), "bench"), ids


def predicted_slice(kv, cal, emb, ids):
    """``kv`` plus the token map's prediction on every token (what such a calibration's K/V look like)."""
    from kvtc.calibration.token_map import lagged

    tm = cal.token_map
    out = {"keys": kv.keys.clone(), "values": kv.values.clone()}
    for t0 in range(0, kv.num_tokens, 4096):
        t1 = min(t0 + 4096, kv.num_tokens)
        lo = max(t0 - tm.lags + 1, 0)
        x = lagged(emb, ids[:, lo:t1], tm.lags)[:, t0 - lo :]
        for kind, t in out.items():
            p = tm.predict(x, kind).view(kv.batch, t1 - t0, *t.shape[2:])
            t[:, t0:t1] = (t[:, t0:t1].float() + p).bfloat16()
    return dataclasses.replace(kv, keys=out["keys"], values=out["values"], token_ids=ids)


def encode_case(mode: str, kv, ids, cals: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Encode ``kv`` as ``mode`` says into ``folder`` (blob, calibration, embeddings); returns the blob's facts."""
    from safetensors.torch import save_file

    from kvtc.codec import Codec

    layout_name, settings, _ = MODES[mode]
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if settings.get("identity"):
        blob = Codec.identity().encode(kv)
    else:
        cal = cals[layout_name]
        emb = None
        if settings.get("token_map"):
            cal, emb = token_map(cal)
            kv = predicted_slice(kv, cal, emb, ids)
            save_file({"weight": emb}, str(folder / "embeddings.safetensors"))
        cal.save(folder / "calibration.safetensors")
        kw = {k: v for k, v in settings.items() if k not in ("token_map",)}
        codec = Codec(cal, RATIO, embeddings=emb, **kw)
        blob = codec.encode(kv, token_ids=ids if emb is not None else None)
    enc_s = time.perf_counter() - t0
    (folder / "blob.kvtc").write_bytes(blob)
    (folder / "codec.json").write_text(json.dumps({"identity": bool(settings.get("identity"))}))
    info = Codec.inspect(blob)
    return {"blob_bytes": len(blob), "encode_s": enc_s, "version": info["version"]}


def run(sizes: list[int], modes: list[str], threads: int | None, baseline: str | None) -> list[dict[str, Any]]:
    layouts = sorted({MODES[m][0] for m in modes if not MODES[m][1].get("identity")})
    cals = {name: calibration(name) for name in layouts}
    rows = []
    per_token = 2 * BATCH * LAYERS * HEADS * HEAD_DIM * 2  # decoded bytes of one token of the batch
    with tempfile.TemporaryDirectory(prefix="kvtc-decode-memory-") as tmp:
        for size in sizes:
            tokens = size * MIB // per_token
            for layout_name in ("dense", "sliding"):
                group = [m for m in modes if MODES[m][0] == layout_name]
                if not group:
                    continue
                kv, ids = make_slice(layout_name, tokens)
                blobs: dict[tuple, Path] = {}
                for mode in group:
                    _, settings, layers = MODES[mode]
                    key = tuple(sorted((k, str(v)) for k, v in settings.items()))
                    folder = Path(tmp) / f"{size}-{layout_name}-{len(blobs)}"
                    facts = {}
                    if key not in blobs:
                        facts = encode_case(mode, kv, ids, cals, folder)
                        blobs[key] = folder
                    got = measure_in_child(blobs[key], layers, threads)
                    extra, dec = got["peak_extra_bytes"], got["decoded_bytes"]
                    if baseline:
                        old = measure_in_child(blobs[key], layers, threads, baseline)
                        facts["before_peak_extra_mib"] = old["peak_extra_bytes"] / MIB
                        facts["before_x_decoded"] = old["peak_extra_bytes"] / dec
                        facts["before_within"] = old["peak_extra_bytes"] <= FACTOR * dec + SLACK
                        facts["before_decode_s"] = old["seconds"]
                    row = {
                        "mode": mode,
                        "size_mib": size,
                        "tokens": tokens,
                        "batch": BATCH,
                        "decoded_mib": dec / MIB,
                        "peak_extra_mib": extra / MIB,
                        "x_decoded": extra / dec,
                        "bound_mib": (FACTOR * dec + SLACK) / MIB,
                        "within": extra <= FACTOR * dec + SLACK,
                        "decode_s": got["seconds"],
                        **facts,
                    }
                    rows.append(row)
                    print(
                        f"{mode:>22} {size:>5} MiB: peak extra {extra / MIB:8.1f} MiB = {extra / dec:.2f}x decoded "
                        f"({'ok' if row['within'] else 'OVER'} <= {row['bound_mib']:.0f} MiB), "
                        f"decode {got['seconds']:.2f} s"
                        + (
                            f"; before: {row['before_x_decoded']:.2f}x, {row['before_decode_s']:.2f} s"
                            if baseline
                            else ""
                        ),
                        flush=True,
                    )
                del kv, ids
    return rows


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    rows = result["rows"]
    sizes = sorted({r["size_mib"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["mode"], r["size_mib"]): r for r in rows}
    baseline = result.get("baseline")
    cells, columns = [], ["mode"]
    for s in sizes:
        columns += [f"{s} MiB"] + ([f"{s} MiB before"] if baseline else [])
    for mode in modes:
        row: dict[str, Any] = {"mode": mode}
        for s in sizes:
            r = by.get((mode, s))
            if r is not None:
                mark = "" if r["within"] else " **over**"
                row[f"{s} MiB"] = f"{r['x_decoded']:.2f}× ({r['peak_extra_mib']:.0f} MiB, {r['decode_s']:.2f} s){mark}"
                if baseline:
                    mark = "" if r["before_within"] else " **over**"
                    row[f"{s} MiB before"] = (
                        f"{r['before_x_decoded']:.2f}× ({r['before_peak_extra_mib']:.0f} MiB, "
                        f"{r['before_decode_s']:.2f} s){mark}"
                    )
        cells.append(row)
    worst = max(rows, key=lambda r: r["peak_extra_mib"] / r["bound_mib"])
    ok = all(r["within"] for r in rows)
    before = (
        f'\n"before" columns: the same blobs decoded, each in a fresh process too, by {baseline}.' if baseline else ""
    )
    return f"""### Decode memory: peak resident memory of a decode against its decoded KV bytes

`{result["command"]}` — {m["date"]}, {m["cpu"]} ({m["cores"]} cores, {m["torch_threads"]} torch threads),
Python {m["python"]}, torch {m["torch"]}, kvtc {m.get("kvtc")} ({m.get("commit", "")}).
Synthetic {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM}, bf16, batch {BATCH}; target {RATIO}x (tiers 8x / 32x, ladder
8x-32x); sliding layouts: five layers in six hold the newest {WINDOW} tokens. Each decode runs in a fresh process after
the codec and the blob are loaded; a cell is the peak resident memory the decode adds (VmHWM after it less VmRSS before,
the result kept alive) over its decoded KV bytes (2 x batch x tokens x features x 2), then MiB and the decode's seconds.
Bound: {FACTOR}x + {SLACK // MIB} MiB; {"every decode is within it" if ok else "**some decodes exceed it**"} (nearest
its bound: {worst["mode"]} at {worst["size_mib"]} MiB, {worst["peak_extra_mib"]:.0f} of {worst["bound_mib"]:.0f} MiB).{before}

{table(cells, columns)}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,256,1024", help="decoded KV sizes in MiB, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the decoding process")
    ap.add_argument("--no-benchmarks-md", action="store_true", help="leave BENCHMARKS.md alone")
    ap.add_argument("--out", default="decode_memory", help="results/<out>.json")
    ap.add_argument("--baseline", metavar="REV", help="also decode each blob with the kvtc of this git revision")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--layers", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        if os.environ.get("KVTC_BENCH_THREADS"):
            torch.set_num_threads(int(os.environ["KVTC_BENCH_THREADS"]))
        print(json.dumps(measure(args.child, args.layers)))
        return
    if not Path("/proc/self/clear_refs").exists():
        sys.exit("this benchmark reads /proc (Linux only)")
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown modes {unknown}; use {list(MODES)}")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="kvtc-baseline-") as tmp:
        baseline_src, baseline = None, None
        if args.baseline:
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], check=True,
                                 capture_output=True, text=True).stdout.strip()  # fmt: skip
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            baseline_src, baseline = os.path.join(tmp, "src"), f"the kvtc of commit {rev}"
        rows = run(sizes, modes, args.threads, baseline_src)
    result = {
        "baseline": baseline,
        "machine": machine(),
        "command": command(),
        "bound": {"factor": FACTOR, "slack_bytes": SLACK},
        "layout": {"layers": LAYERS, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16", "batch": BATCH},
        "rows": rows,
    }
    write_json(args.out, result)
    md = markdown(result)
    if not args.no_benchmarks_md:
        update_section("decode_memory", md)
    print(md)
    print(f"wrote {RESULTS / (args.out + '.json')}")


if __name__ == "__main__":
    main()
