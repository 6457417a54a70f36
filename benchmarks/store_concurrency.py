"""Concurrency benchmark for the stores: N processes put and get overlapping keys for S seconds.

    python benchmarks/store_concurrency.py                      # file, Redis, 3-node Redis Cluster; 8 procs, 60 s each
    python benchmarks/store_concurrency.py --stores redis,redis-cluster,valkey,valkey-cluster --seconds 20

Each value carries its own checksum and the key it was written for, independent of the store's
envelope, so a reader can tell a torn, corrupt or misdirected value from a good one; any such read
is a *corrupt read* and must never happen. The file store runs with a byte budget smaller than the
working set, so eviction runs concurrently with reads and writes. For ``redis`` a throwaway
redis-server is started on a free port unless ``--redis-url`` names one; ``redis-cluster`` starts
three redis-server masters in cluster mode (``valkey`` and ``valkey-cluster`` the same with
valkey-server), all on this machine.

Writes JSON to benchmarks/results/store_concurrency.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "store_concurrency.json"

#: Workload defaults: overlapping keys, value sizes of compressed KV chunks, half puts.
DEFAULT_PROCS = 8
DEFAULT_SECONDS = 60.0
DEFAULT_KEYS = 256
DEFAULT_MIN_VALUE = 16 << 10
DEFAULT_MAX_VALUE = 256 << 10
DEFAULT_WRITE_FRACTION = 0.5
#: File-store budget: about half the working set, so eviction is exercised throughout.
DEFAULT_FILE_BUDGET = 16 << 20
#: Stores on servers this script starts: one server, or three masters in cluster mode (tests/redis_server.py).
SERVER_KINDS = ("redis", "redis-cluster", "valkey", "valkey-cluster")

_VALUE_HEAD = struct.Struct("<16sIQI")  # blake2b(key), writer, sequence, body length
_VALUE_DIGEST = 16


def make_value(key: str, writer: int, seq: int, body: bytes) -> bytes:
    """A value that names its key and checks itself: head || body || blake2b(head || body)."""
    head = _VALUE_HEAD.pack(hashlib.blake2b(key.encode(), digest_size=16).digest(), writer, seq, len(body))
    return head + body + hashlib.blake2b(head + body, digest_size=_VALUE_DIGEST).digest()


def value_ok(key: str, value: bytes) -> bool:
    """Whether `value` is an intact value written by `make_value` for `key`."""
    if len(value) < _VALUE_HEAD.size + _VALUE_DIGEST:
        return False
    key_digest, _, _, length = _VALUE_HEAD.unpack_from(value)
    if len(value) != _VALUE_HEAD.size + length + _VALUE_DIGEST:
        return False
    if key_digest != hashlib.blake2b(key.encode(), digest_size=16).digest():
        return False
    return hashlib.blake2b(value[:-_VALUE_DIGEST], digest_size=_VALUE_DIGEST).digest() == value[-_VALUE_DIGEST:]


def process_context() -> Any:
    """Processes for store workloads: forkserver children of a clean interpreter that has already
    imported the store (importing kvtc costs seconds; a hundred short-lived writers cannot pay that)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["kvtc.store", "store_concurrency"])
    return ctx


def write_until_killed(url: str, namespace: str, keys: int, sizes: tuple[int, int], seed: int, ready: Any) -> None:
    """Put self-checking values under random keys forever; sets `ready` after the first put.
    The crash test SIGKILLs it at a random moment."""
    from kvtc.store import open_store

    rng = random.Random(seed)
    pool = rng.randbytes(sizes[1] * 2)
    store = open_store(url, namespace)
    seq = 0
    while True:
        key = f"chunk-{rng.randrange(keys)}"
        size = rng.randint(*sizes)
        offset = rng.randrange(len(pool) - size)
        store.put(key, make_value(key, seed, seq, pool[offset : offset + size]))
        seq += 1
        ready.set()


def worker(url: str, namespace: str, writer: int, cfg: dict[str, Any], start_at: float, out: Any) -> None:
    """One benchmark process: waits for `start_at` (wall clock), then runs the mix for cfg seconds."""
    from kvtc.store import open_store

    rng = random.Random(cfg["seed"] * 1000 + writer)
    pool = rng.randbytes(cfg["max_value"] * 2)
    store = open_store(url, namespace)
    counts = {
        "puts": 0,
        "put_failures": 0,
        "gets": 0,
        "hits": 0,
        "corrupt_reads": 0,
        "bytes_written": 0,
        "bytes_read": 0,
    }
    put_lat: list[float] = []
    get_lat: list[float] = []
    trace: list[tuple[float, int, bool, bool]] | None = [] if cfg.get("trace") else None
    seq = 0
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.perf_counter()
    deadline = t0 + cfg["seconds"]
    while True:
        now = time.perf_counter()
        if now >= deadline:
            break
        index = rng.randrange(cfg["keys"])
        key = f"chunk-{index}"
        if rng.random() < cfg["write_fraction"]:
            size = rng.randint(cfg["min_value"], cfg["max_value"])
            offset = rng.randrange(len(pool) - size)
            value = make_value(key, writer, seq, pool[offset : offset + size])
            seq += 1
            ok = store.put(key, value)
            put_lat.append(time.perf_counter() - now)
            counts["puts"] += 1
            if ok:
                counts["bytes_written"] += len(value)
            else:
                counts["put_failures"] += 1
            if trace is not None:
                trace.append((time.time(), index, True, ok))
        else:
            value = store.get(key)
            get_lat.append(time.perf_counter() - now)
            counts["gets"] += 1
            if value is not None:
                if value_ok(key, value):
                    counts["hits"] += 1
                    counts["bytes_read"] += len(value)
                else:
                    counts["corrupt_reads"] += 1
            if trace is not None:
                trace.append((time.time(), index, False, value is not None))
    elapsed = time.perf_counter() - t0
    stats = store.stats()
    store.close()
    out.put(
        {
            "writer": writer,
            "elapsed": elapsed,
            "counts": counts,
            "store_stats": stats,
            "put_latency": put_lat,
            "get_latency": get_lat,
            "trace": trace,
        }
    )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def start_workers(url: str, namespace: str, cfg: dict[str, Any]) -> tuple[float, Any, list[Any]]:
    """Start `cfg["procs"]` workers against `url`; returns (wall-clock start time, result queue, processes)."""
    ctx = process_context()
    out = ctx.Queue()
    start_at = time.time() + cfg["warmup"]
    procs = [ctx.Process(target=worker, args=(url, namespace, i, cfg, start_at, out)) for i in range(cfg["procs"])]
    for p in procs:
        p.start()
    return start_at, out, procs


def collect_workers(kind: str, cfg: dict[str, Any], out: Any, procs: list[Any]) -> list[dict[str, Any]]:
    """The workers' reports, once all have exited cleanly (a worker that raised fails the run)."""
    reports = []
    for _ in procs:
        try:
            reports.append(out.get(timeout=cfg["seconds"] + cfg["warmup"] + 120))
        except Exception:  # noqa: BLE001 - a worker died before reporting
            break
    for p in procs:
        p.join(timeout=30)
    if len(reports) != len(procs) or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{kind}: a worker exited with {[p.exitcode for p in procs]}")
    return reports


def run_store(kind: str, url: str, namespace: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run `cfg["procs"]` workers against `url`; return the aggregated result for one store."""
    _, out, procs = start_workers(url, namespace, cfg)
    return summarize(kind, cfg, collect_workers(kind, cfg, out, procs))


def summarize(kind: str, cfg: dict[str, Any], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One store's figures from its workers' reports."""
    total = {k: sum(r["counts"][k] for r in reports) for k in reports[0]["counts"]}
    store_stats = {k: sum(r["store_stats"][k] for r in reports) for k in ("corrupt", "errors", "evictions")}
    elapsed = max(r["elapsed"] for r in reports)
    put_lat = [x for r in reports for x in r["put_latency"]]
    get_lat = [x for r in reports for x in r["get_latency"]]
    mb = 1e6
    return {
        "store": kind,
        "procs": cfg["procs"],
        "seconds": round(elapsed, 2),
        **total,
        "store_corrupt": store_stats["corrupt"],
        "store_errors": store_stats["errors"],
        "store_evictions": store_stats["evictions"],
        "ops_per_s": round((total["puts"] + total["gets"]) / elapsed, 1),
        "puts_per_s": round(total["puts"] / elapsed, 1),
        "gets_per_s": round(total["gets"] / elapsed, 1),
        "write_MB_per_s": round(total["bytes_written"] / elapsed / mb, 2),
        "read_MB_per_s": round(total["bytes_read"] / elapsed / mb, 2),
        "hit_rate": round(total["hits"] / total["gets"], 3) if total["gets"] else None,
        "put_p50_ms": round(_percentile(put_lat, 0.5) * 1e3, 2),
        "put_p99_ms": round(_percentile(put_lat, 0.99) * 1e3, 2),
        "get_p50_ms": round(_percentile(get_lat, 0.5) * 1e3, 2),
        "get_p99_ms": round(_percentile(get_lat, 0.99) * 1e3, 2),
    }


def markdown_table(results: list[dict[str, Any]]) -> str:
    cols = [
        ("store", "store"),
        ("procs", "procs"),
        ("seconds", "s"),
        ("ops_per_s", "ops/s"),
        ("puts_per_s", "puts/s"),
        ("gets_per_s", "gets/s"),
        ("write_MB_per_s", "write MB/s"),
        ("read_MB_per_s", "read MB/s"),
        ("hit_rate", "hit rate"),
        ("put_p50_ms", "put p50 ms"),
        ("put_p99_ms", "put p99 ms"),
        ("get_p50_ms", "get p50 ms"),
        ("get_p99_ms", "get p99 ms"),
        ("corrupt_reads", "corrupt reads"),
        ("store_evictions", "evictions"),
    ]
    lines = ["| " + " | ".join(title for _, title in cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(str(r[key]) for key, _ in cols) + " |")
    return "\n".join(lines)


def _server_version(kind: str) -> str | None:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from redis_server import server_binary

    binary = server_binary(kind)
    if binary is None:
        return None
    text = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    return next((w[2:] for w in text.split() if w.startswith("v=")), text.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--stores",
        default="file,redis,redis-cluster",
        help="comma-separated list of file, redis, redis-cluster, valkey, valkey-cluster "
        "(memory:// is per process, so not benchmarked)",
    )
    ap.add_argument("--procs", type=int, default=DEFAULT_PROCS)
    ap.add_argument("--seconds", type=float, default=DEFAULT_SECONDS)
    ap.add_argument("--keys", type=int, default=DEFAULT_KEYS)
    ap.add_argument("--min-value", type=int, default=DEFAULT_MIN_VALUE)
    ap.add_argument("--max-value", type=int, default=DEFAULT_MAX_VALUE)
    ap.add_argument("--write-fraction", type=float, default=DEFAULT_WRITE_FRACTION)
    ap.add_argument("--file-budget", type=int, default=DEFAULT_FILE_BUDGET, help="file store max_bytes")
    ap.add_argument("--file-root", default=None, help="directory for the file store (default: a temp dir)")
    ap.add_argument("--redis-url", default=None, help="use this server instead of starting one")
    ap.add_argument("--masters", type=int, default=3, help="masters of the *-cluster stores")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    results = benchmark(
        stores=args.stores.split(","),
        procs=args.procs,
        seconds=args.seconds,
        keys=args.keys,
        min_value=args.min_value,
        max_value=args.max_value,
        write_fraction=args.write_fraction,
        file_budget=args.file_budget,
        file_root=args.file_root,
        redis_url=args.redis_url,
        seed=args.seed,
        masters=args.masters,
    )
    import redis

    from _report import machine, update_section

    facts = machine()
    stores = args.stores.split(",")
    report = {
        "date": facts["date"],
        "command": " ".join(["python", "benchmarks/store_concurrency.py", *(sys.argv[1:] if argv is None else argv)]),
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "redis_server": _server_version("redis"),
        "valkey_server": _server_version("valkey") if any(k.startswith("valkey") for k in stores) else None,
        "cpu": facts.get("cpu"),
        "cpus": os.cpu_count(),
        "commit": facts.get("commit"),
        "platform": platform.platform(),
        "load_avg_1_5_15_before": [round(x, 2) for x in load_before],
        "load_avg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
        "workload": {
            "procs": args.procs,
            "cluster_masters": args.masters,
            "seconds": args.seconds,
            "keys": args.keys,
            "value_bytes": [args.min_value, args.max_value],
            "write_fraction": args.write_fraction,
            "file_budget_bytes": args.file_budget,
        },
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if out.resolve() == RESULTS.resolve():
        update_section("store_concurrency", markdown_report(report, full=False), details=markdown_report(report))
    print(markdown_table(results))
    bad = sum(r["corrupt_reads"] + r["store_corrupt"] for r in results)
    return 1 if bad else 0


def markdown_report(report: dict[str, Any], full: bool = True) -> str:
    """The report of one run: in full (docs/results/store_concurrency.md), or without its notes on how the stores
    ran and what the figures mean (``full=False``: the BENCHMARKS.md section)."""
    w = report["workload"]
    servers = ", ".join(
        f"{name} {report[key]}"
        for name, key in (("redis-server", "redis_server"), ("valkey-server", "valkey_server"))
        if report[key]
    )
    load = report["load_avg_1_5_15_before"][0], report["load_avg_1_5_15_after"][0]
    m = w.get("cluster_masters", 3)
    budget = (
        f", file budget {w['file_budget_bytes'] >> 20} MiB (below the working set, so eviction runs throughout)"
        if any(r["store"] == "file" for r in report["results"])
        else ""
    )
    notes = f"""
Each store ran alone, one after the other, in the same run. A cluster is {m} masters (no replicas) on this
same machine, started by the script: its figures are the client's slot routing plus {m} server processes
sharing the same cores, not {m} machines' capacity. The machine was shared with other jobs (1-minute load
average {load[0]} before, {load[1]} after): the figures are a floor, not a capability, comparable only within
this run."""
    return f"""### Store concurrency: file, one server, {m}-master cluster (issues 5 and 19)

`{report["command"]}` — {report["date"]}, {report["cpu"]} ({report["cpus"]} cores), Python {report["python"]}, \
redis-py {report["redis_py"]}, {servers}, commit {report["commit"]}. \
{w["procs"]} processes, {w["seconds"]:g} s per store, {w["keys"]} overlapping keys, values \
{w["value_bytes"][0] >> 10}–{w["value_bytes"][1] >> 10} KiB, {w["write_fraction"]:.0%} puts{budget}.{notes if full else ""}

{markdown_table(report["results"])}

Results: `benchmarks/results/store_concurrency.json`."""


def benchmark(
    stores: list[str],
    procs: int = DEFAULT_PROCS,
    seconds: float = DEFAULT_SECONDS,
    keys: int = DEFAULT_KEYS,
    min_value: int = DEFAULT_MIN_VALUE,
    max_value: int = DEFAULT_MAX_VALUE,
    write_fraction: float = DEFAULT_WRITE_FRACTION,
    file_budget: int = DEFAULT_FILE_BUDGET,
    file_root: str | None = None,
    redis_url: str | None = None,
    seed: int = 0,
    warmup: float = 1.0,
    masters: int = 3,
) -> list[dict[str, Any]]:
    """Run the workload on each store in turn; returns one result dict per store."""
    cfg = {
        "procs": procs,
        "seconds": seconds,
        "keys": keys,
        "min_value": min_value,
        "max_value": max_value,
        "write_fraction": write_fraction,
        "seed": seed,
        "warmup": warmup,
    }
    namespace = "bench-model:bench-calibration"
    results = []
    for kind in stores:
        if kind == "file":
            root = file_root or tempfile.mkdtemp(prefix="kvtc-store-bench-")
            try:
                url = f"file://{os.path.abspath(root)}?max_bytes={file_budget}"
                results.append(run_store(kind, url, namespace, cfg))
            finally:
                if file_root is None:
                    shutil.rmtree(root, ignore_errors=True)
        elif kind in SERVER_KINDS:
            if kind == "redis" and redis_url is not None:
                results.append(run_store(kind, redis_url, namespace, cfg))
                continue
            sys.path.insert(0, str(HERE.parent / "tests"))
            from redis_server import LocalCluster, RedisServer

            server_kind = kind.split("-")[0]
            server = LocalCluster(masters, server_kind) if kind.endswith("-cluster") else RedisServer(kind=server_kind)
            with server as srv:
                results.append(run_store(kind, srv.url, namespace, cfg))
        else:
            raise SystemExit(f"unknown store {kind!r}: use file, {', '.join(SERVER_KINDS)} (memory:// is per process)")
    return results


if __name__ == "__main__":
    sys.exit(main())
