"""Hostile input to the stores: a seeded loop over store URLs, a hostile RESP server, a real redis-server's
keys holding anything, and file-store entry paths planted with anything.

Parts (each input belongs to one):

* ``url``: ``open_store`` on URLs built from random schemes, hosts, ports, paths and options (numbers that
  are NaN, infinite, huge, negative, with units, unicode digits, empty). Property: a store or StoreError.
  Redis stores are only opened and closed (opening connects to nothing); file URLs stay inside a temp dir.
* ``resp``: a tiny TCP server in this process answers every command with random replies (nested, garbled,
  truncated, errors such as MOVED/ASK/WRONGTYPE, 100,000-deep arrays, arrays announcing ten million elements,
  bulk strings announcing gigabytes, non-RESP bytes), sometimes dripped a byte every 30 ms, and ``CLUSTER
  SLOTS`` with random slot maps (loopback or unusable hosts only; some naming 16,384 masters). Besides the
  common property, each call must return within ``CALL_TIMEOUTS`` x the store's timeout + ``SLOW_MARGIN_S``
  (violation ``slow``).
* ``redis``: a real ``redis-server`` (started here on a free loopback port when one is on PATH) whose entry
  keys hold random bytes, foreign envelopes, truncated envelopes, or lists/hashes/sets/zsets/streams/ints.
  Needs the ``redis`` package (to plant the keys).
* ``file``: a FileStore whose entry paths hold FIFOs, directories, symlinks (outside, dangling, looping,
  /dev/zero), empty files, random bytes, truncated or foreign entries, sparse 64 MiB files, envelopes whose
  header declares more than ``max_entry_bytes`` (in a sparse file of that size, or a small one), shard
  directories that are links to a directory outside the root holding a valid entry, and temp-file names that
  are links to a file outside. Besides the common property: nothing outside the root changes (violation
  ``wrote_outside``), no entry is read through a link (``wrong_hit``), and the process's peak RSS grows by at
  most ``FILE_RSS_LIMIT`` (``memory``).

Property for every store operation (get, put, contains, get_many, put_many, delete): it returns a value
of the documented type (a miss / False where the entry is unusable), never raises, and returns within
``OP_TIMEOUT_S``.

    python fuzz/fuzz_store.py --runs 2000 --seed 1 --out store.json
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import Hung, Tally, call_with_timeout, campaign_args, hwm, reset_hwm, write_summary  # noqa: E402

NS = "model:calibration"
OP_TIMEOUT_S = 10.0
TIME_LIMIT_S = OP_TIMEOUT_S
#: The resp part's store timeout, and what a call may take beyond its CALL_TIMEOUTS x timeout.
RESP_TIMEOUT_S = 0.05
SLOW_MARGIN_S = 0.75
#: Seconds per byte of a dripped reply, and how long the server drips one before hanging up.
DRIP_S = 0.03
DRIP_FOR_S = 1.0
#: The file part's entry size limit, and the peak RSS growth allowed in one file input.
FILE_MAX_ENTRY = 1 << 20
FILE_RSS_LIMIT = 48 << 20

SCHEMES = [
    "memory",
    "redis",
    "rediss",
    "redis+cluster",
    "rediss+cluster",
    "REDIS",
    "Redis+Cluster",
    "ftp",
    "valkey",
    "s3",
    "file",
    "",
    "http",
    "redis+",
    "+cluster",
]
OPTION_NAMES = [
    "ttl",
    "timeout",
    "retry_interval",
    "prefix",
    "max_bytes",
    "evict_to",
    "tmp_grace",
    "sweep_interval",
    "budget",
    "",
    "TTL",
    "db",
]
NUMBERS = [
    "inf",
    "-inf",
    "nan",
    "1e400",
    "-0",
    "0",
    "1e-300",
    "0x10",
    "1_000",
    " 5",
    "\u0663",
    "1e308",
    "99999999999999999999999999",
    "18446744073709551616",
    "64MiB",
    "2G",
    "1k",
    "-1",
    "",
    "%00",
    "1.5",
    "3600",
    "0.05",
    "1e-9",
    "5 ",
    "+5",
    "1e3",
    "64mib",
    "1 KiB",
    "0b1",
    "NaN",
    "\u00bd",
    "9" * 400,
]
NETLOCS = [
    "",
    "h",
    "h:1",
    "h:0",
    "h:65536",
    "h:-1",
    "h:x",
    "[::1]:7000",
    "[::1",
    "::1]",
    "u:p@h:1",
    "a:1,b:2",
    "a:1,,b",
    ",",
    "@",
    "h:1:2",
    "%zz",
    "h%00",
    "a b",
    "[]:1",
    "h:" + "9" * 30,
    "127.0.0.1:6379",
    ":@",
    "u@",
    "x" * 300,
    "h:1," * 200,
    "\u00e9:1",
    "[v1.x]:1",
    "h\t:1",
]
PATHS = ["", "/", "/0", "/3", "/x", "/-1", "/99999999999", "/0/1", "/%2e%2e", "//", "/" + "a" * 300, "/16", "/\u0663"]
TAILS = ["", "#frag", "?", "?&", "?a", "?=1", "?a=1&a=2", "#"]


def _rtext(rng: random.Random, n: int) -> str:
    alphabet = "abc019:/?#[]@!$&'()*+,;=%-._~ \t\x00\u00e9\u0663\ud7ff\U0001f600"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(n + 1)))


def random_query(rng: random.Random) -> str:
    pairs = []
    for _ in range(rng.choice((0, 1, 1, 2, 4))):
        name = rng.choice(OPTION_NAMES) if rng.random() < 0.9 else _rtext(rng, 6)
        value = (
            rng.choice(NUMBERS)
            if rng.random() < 0.7
            else (repr(rng.uniform(-1e6, 1e6)) if rng.random() < 0.5 else _rtext(rng, 10))
        )
        pairs.append(f"{name}={value}")
    return "&".join(pairs)


def random_url(rng: random.Random, tmp: Path) -> str:
    r = rng.random()
    q = random_query(rng)
    if r < 0.2:  # a file store, always inside tmp
        name = _rtext(rng, 12).replace("/", "_").replace("\x00", "") or "s"
        if name in (".", ".."):
            name = "s"
        prefix = rng.choice(["file://", ""])
        return f"{prefix}{tmp}/{name}" + (f"?{q}" if q else "") + rng.choice(["", "", "#x"])
    if r < 0.25:
        return _rtext(rng, 40)  # anything: read as a relative path (the process runs in tmp), or refused
    scheme = rng.choice(SCHEMES[:-5]) if rng.random() < 0.9 else rng.choice(SCHEMES)
    if scheme in ("", "file"):
        scheme = "memory"
    netloc = rng.choice(NETLOCS) if rng.random() < 0.8 else _rtext(rng, 20)
    path = rng.choice(PATHS) if rng.random() < 0.8 else _rtext(rng, 10)
    return f"{scheme}://{netloc}{path}" + (f"?{q}" if q else "") + rng.choice(TAILS)


# ------------------------------------------------------------------------------------------ RESP replies
def _line(b: bytes) -> bytes:
    return b.replace(b"\r", b"").replace(b"\n", b"")


def _resp(items: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(items) + b"".join(items)


FIXED_LEAVES = [
    b"-MOVED\r\n",
    b"-MOVED x\r\n",
    b"-MOVED 1 127.0.0.1:1\r\n",
    b"-ASK 99999 :\r\n",
    b"-CLUSTERDOWN The cluster is down\r\n",
    b"-WRONGTYPE x\r\n",
    b"-LOADING\r\n",
    b"-TRYAGAIN\r\n",
    b"-OOM\r\n",
    b"$-1\r\n",
    b"*-1\r\n",
    b"_\r\n",
    b"%1\r\n+a\r\n+b\r\n",
    b"$5\r\nab\r\n",
    b"$99999999999\r\n",
    b":x\r\n",
    b"*x\r\n",
    b"\r\n",
    b"+OK\r\n",
    b":1\r\n",
    b":0\r\n",
    b"*0\r\n",
    b"$0\r\n\r\n",
    b"-ERR unknown command\r\n",
    b"-NOSCRIPT\r\n",
    b"-READONLY\r\n",
    b"*2\r\n:0\r\n*0\r\n",
]


def leaf(rng: random.Random, envelopes: list[bytes]) -> bytes:
    r = rng.random()
    if r < 0.15:
        return b"+" + _line(rng.randbytes(rng.randrange(30))) + b"\r\n"
    if r < 0.25:
        return b"-" + _line(rng.randbytes(rng.randrange(30))) + b"\r\n"
    if r < 0.5:
        return rng.choice(FIXED_LEAVES)
    if r < 0.6:
        return b":%d\r\n" % rng.randint(-(2**70), 2**70)
    if r < 0.75:
        b = rng.randbytes(rng.randrange(120))
        return b"$%d\r\n%s\r\n" % (len(b), b)
    if r < 0.9:
        b = rng.choice(envelopes)
        if rng.random() < 0.3:
            b = b[: rng.randrange(len(b) + 1)]
        return b"$%d\r\n%s\r\n" % (len(b), b)
    return rng.randbytes(rng.randrange(12))


def tree(rng: random.Random, envelopes: list[bytes], depth: int = 0) -> bytes:
    if depth > 3 or rng.random() < 0.6:
        return leaf(rng, envelopes)
    return _resp([tree(rng, envelopes, depth + 1) for _ in range(rng.randrange(5))])


def reply(rng: random.Random, envelopes: list[bytes]) -> bytes:
    r = rng.random()
    if r < 0.1:
        return b"*1\r\n" * rng.choice((2, 100, 1000, 5000, 100_000)) + leaf(rng, envelopes)
    if r < 0.15:  # an array announcing ten million elements (or just past the client's bound), then a few
        return b"*%d\r\n" % rng.choice((10_000_000, 65_537, 2**31)) + b":1\r\n" * rng.randrange(1000)
    if r < 0.2:  # a bulk string announcing up to gigabytes, then a few bytes
        return b"$%d\r\n" % rng.choice((600 << 20, 10 << 30, 2**62)) + rng.randbytes(rng.randrange(4096))
    return tree(rng, envelopes)


def many_masters(n: int, first_port: int = 20_000) -> bytes:
    """A CLUSTER SLOTS reply giving each of `n` loopback masters its share of the slots."""
    ranges = []
    for i in range(n):
        lo, hi = i * 16384 // n, (i + 1) * 16384 // n - 1
        if lo <= hi:
            node = b"*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % (first_port + i)
            ranges.append(b"*3\r\n:%d\r\n:%d\r\n" % (lo, hi) + node)
    return _resp(ranges)


def slots_reply(rng: random.Random, port: int) -> bytes:
    """CLUSTER SLOTS answers: the right one and malformed ones; hosts are loopback or unusable."""
    here = b"$9\r\n127.0.0.1\r\n:%d\r\n" % port
    good = b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n" + here
    r = rng.random()
    if r < 0.3:
        return good
    if r < 0.35:  # every slot on its own master (or just over the masters a map may name): refused
        return many_masters(rng.choice((16384, 1001)))
    if r < 0.5:
        return rng.choice(
            [
                b"*1\r\n" * 5000 + b":1\r\n",
                b"-ERR This instance has cluster support disabled\r\n",
                b"$-1\r\n",
                b":1\r\n",
                b"*1\r\n:1\r\n",
                b"$3\r\nabc\r\n",
                b"nonsense",
            ]
        )
    hosts = [
        b"$0\r\n\r\n",
        b"$1\r\n?\r\n",
        b"$9\r\n127.0.0.1\r\n",
        b"$2\r\n\xff\xfe\r\n",
        b"$4\r\na b\x00\r\n",
        b":1\r\n",
        b"*0\r\n",
    ]
    ports = [b":%d\r\n" % port, b":0\r\n", b":-1\r\n", b":70000\r\n", b"$4\r\n6379\r\n", b"$-1\r\n"]
    slot = [b":0\r\n", b":16383\r\n", b":16384\r\n", b":-1\r\n", b"$1\r\n0\r\n", b"*0\r\n"]
    entries = [
        b"*3\r\n" + rng.choice(slot) + rng.choice(slot) + b"*2\r\n" + rng.choice(hosts) + rng.choice(ports)
        for _ in range(rng.randrange(4))
    ]
    return _resp(entries)


class HostileServer(socketserver.ThreadingTCPServer):
    """A real TCP server on 127.0.0.1 that reads RESP commands and answers each with the next of ``replies``
    (cycled); ``CLUSTER SLOTS`` gets ``slots``. With ``drip`` (seconds), each reply goes out one byte at a time,
    for at most ``DRIP_FOR_S`` seconds, and the connection is then closed."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.port = self.server_address[1]
        self.replies: list[bytes] = [b"+OK\r\n"]
        self.slots = b"*0\r\n"
        self.drip = 0.0
        self.count = 0
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def answer(self, command: list[bytes]) -> bytes:
        if [c.upper() for c in command[:2]] == [b"CLUSTER", b"SLOTS"]:
            return self.slots
        self.count += 1
        return self.replies[self.count % len(self.replies)]

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        try:
            while True:
                line = self.rfile.readline()
                if not line or not line.startswith(b"*"):
                    return
                args = []
                for _ in range(int(line[1:])):
                    n = int(self.rfile.readline()[1:])
                    args.append(self.rfile.read(n + 2)[:-2])
                data = self.server.answer(args)  # type: ignore[attr-defined]
                drip = self.server.drip  # type: ignore[attr-defined]
                if not drip:
                    self.wfile.write(data)
                    self.wfile.flush()
                    continue
                until = time.monotonic() + DRIP_FOR_S
                for i in range(len(data)):  # bounded: by the reply's length and by DRIP_FOR_S
                    if time.monotonic() > until:
                        return
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
                    time.sleep(drip)
        except (OSError, ValueError):
            return


# ------------------------------------------------------------------------------------------ a real server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RealServer:
    """A throwaway redis-server (no persistence) on a free loopback port, or None when there is no binary."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"*1\r\n$4\r\nPING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def plant_redis(client: Any, name: str, rng: random.Random, envelopes: list[bytes]) -> tuple[str, bytes]:
    client.delete(name)
    kind = rng.choice(
        ["bytes", "bytes", "magic", "envelope", "truncated", "list", "hash", "set", "zset", "stream", "int"]
    )
    data = rng.randbytes(rng.randrange(1, 300))
    if kind == "bytes":
        client.set(name, data)
    elif kind == "magic":
        data = b"KVTS\x01\x00" + data[:60]
        client.set(name, data)
    elif kind in ("envelope", "truncated"):
        env = rng.choice(envelopes)
        data = env if kind == "envelope" else env[: rng.randrange(len(env))]
        client.set(name, data)
    elif kind == "list":
        client.rpush(name, data)
    elif kind == "hash":
        client.hset(name, data, data)
    elif kind == "set":
        client.sadd(name, data)
    elif kind == "zset":
        client.zadd(name, {data: 1.5})
    elif kind == "stream":
        client.xadd(name, {data: data})
    else:
        client.set(name, 12345)
        client.incr(name)
    return kind, data


# ------------------------------------------------------------------------------------------ files
LINK_KINDS = ("shard_link", "leaf_link")


def _claim(path: Path, key: str, payload_bytes: int, file_bytes: int | None) -> None:
    """An envelope header for (NS, key) declaring `payload_bytes` of payload, in a sparse file of `file_bytes`
    (None: the size the header declares)."""
    import struct

    from kvtc.store.base import HEADER_SIZE, MAGIC

    ns, k = NS.encode(), key.encode()
    head = struct.pack("<4sBBHHHQ", MAGIC, 1, 0, len(ns), len(k), 0, payload_bytes) + bytes(16) + ns + k
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(HEADER_SIZE + len(ns) + len(k) + payload_bytes if file_bytes is None else file_bytes)


def _unplant_dirs(path: Path) -> None:
    """Remove links (or files) a previous input left where the entry's shard directories belong."""
    for d in (path.parent.parent, path.parent):
        if d.is_symlink() or (os.path.lexists(d) and not d.is_dir()):
            d.unlink()


def plant_file(
    store: Any, key: str, rng: random.Random, tmp: Path, envelopes: list[bytes], shared_shard: bool = False
) -> str:
    from kvtc.store import seal

    path = store.path_of(key)
    _unplant_dirs(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    kind = rng.choice(
        [
            "fifo",
            "dir",
            "dir_full",
            "symlink_outside",
            "symlink_dangling",
            "symlink_loop",
            "dev_zero",
            "empty",
            "random",
            "truncated",
            "foreign",
            "other_ns",
            "sparse",
            "oversized",
            "oversized_small",
            "shard_link",
            "leaf_link",
            "tmp_link",
            "good",
        ]
    )
    if kind in LINK_KINDS and shared_shard:  # another key of this input lives in that shard
        kind = "random"
    outside = tmp / "outside"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "dir_full":
        path.mkdir()
        (path / "x").write_bytes(b"x")
    elif kind == "symlink_outside":
        outside.write_bytes(seal(NS, key, b"from outside the store"))
        path.symlink_to(outside)
    elif kind == "symlink_dangling":
        path.symlink_to(tmp / "nowhere" / "x")
    elif kind == "symlink_loop":
        path.symlink_to(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        path.write_bytes(rng.randbytes(rng.randrange(1, 4096)))
    elif kind == "truncated":
        env = seal(NS, key, rng.randbytes(200))
        path.write_bytes(env[: rng.randrange(len(env))])
    elif kind == "foreign":
        path.write_bytes(seal(NS, key + "x", b"payload"))
    elif kind == "other_ns":
        path.write_bytes(seal("other:ns", key, b"payload"))
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(64 << 20)
    elif kind == "oversized":  # header and file agree on 64 MiB, more than the store's max_entry_bytes
        _claim(path, key, 64 << 20, None)
    elif kind == "oversized_small":  # the header declares 5 GiB, the file is small
        _claim(path, key, 5 << 30, rng.randrange(100, 4096))
    elif kind in LINK_KINDS:  # the shard (or leaf) directory is a link to a tree outside holding a valid entry
        tree = tmp / "outside_tree"
        real = tree / path.parent.parent.name / path.parent.name
        real.mkdir(parents=True, exist_ok=True)
        (real / path.name).write_bytes(seal(NS, key, b"from outside the store"))
        shutil.rmtree(path.parent if kind == "leaf_link" else path.parent.parent)
        if kind == "leaf_link":
            path.parent.symlink_to(real, target_is_directory=True)
        else:
            path.parent.parent.symlink_to(real.parent, target_is_directory=True)
    elif kind == "tmp_link":  # a stale temp file name that is a link to a file outside (sweeps remove the link)
        outside.write_bytes(b"outside the store")
        link = path.parent / f".{path.stem}.1.0badc0de.tmp"
        if os.path.lexists(link):
            link.unlink()
        link.symlink_to(outside)
        os.utime(link, (1, 1), follow_symlinks=False)
        path.write_bytes(seal(NS, key, b"payload"))
    else:
        path.write_bytes(seal(NS, key, b"payload"))
    return kind


# ------------------------------------------------------------------------------------------ checks
def _typed(op: str, value: Any, keys: list[str]) -> str | None:
    """None when ``value`` is what ``op`` returns, else what is wrong."""
    if op in ("get",):
        ok = value is None or isinstance(value, bytes)
    elif op in ("put", "contains", "delete"):
        ok = isinstance(value, bool)
    elif op == "get_many":
        ok = (
            isinstance(value, dict)
            and set(value) == set(keys)
            and all(v is None or isinstance(v, bytes) for v in value.values())
        )
    elif op == "put_many":
        ok = isinstance(value, dict) and set(value) == set(keys) and all(isinstance(v, bool) for v in value.values())
    elif op == "clear":
        ok = isinstance(value, int)
    else:
        ok = True
    return None if ok else f"{op} returned {value!r:.200}"


def run_ops(
    store: Any,
    ops: list[tuple[str, Callable[[], Any], list[str]]],
    unblock: Callable[[], None] | None = None,
    first: list | None = None,
) -> tuple[str, float, tuple[str, str] | None]:
    """Run each op with a time limit; (outcome, slowest op seconds, violation or None). The first op's
    result is appended to ``first`` when given."""
    slowest = 0.0
    for op, fn, keys in ops:
        t0 = time.perf_counter()
        try:
            value = call_with_timeout(fn, OP_TIMEOUT_S, unblock)
        except Hung as e:
            return "hang", time.perf_counter() - t0, ("hang", f"{op}: {e}")
        except Exception as e:  # noqa: BLE001 - the property under test
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            return type(e).__name__, time.perf_counter() - t0, ("exception", f"{op}: {type(e).__name__}: {e}\n{tb}")
        dt = time.perf_counter() - t0
        slowest = max(slowest, dt)
        if dt >= OP_TIMEOUT_S:  # it returned only once a blocked read was given EOF
            return "hang", dt, ("hang", f"{op}: blocked for {OP_TIMEOUT_S:g} s")
        if first is not None and not first:
            first.append(value)
        wrong = _typed(op, value, keys)
        if wrong:
            return "wrong_type", slowest, ("wrong_type", wrong)
    return "ok", slowest, None


def _ops(store: Any, with_clear: bool = False) -> list[tuple[str, Callable[[], Any], list[str]]]:
    ks = ["k0", "k1", "k2"]
    ops = [
        ("get", lambda: store.get("k0"), []),
        ("contains", lambda: store.contains("k0"), []),
        ("get_many", lambda: store.get_many(ks), ks),
        ("put", lambda: store.put("k0", b"v"), []),
        ("put_many", lambda: store.put_many({"a": b"1", "b": b"2"}), ["a", "b"]),
        ("delete", lambda: store.delete("k1"), []),
    ]
    if with_clear:
        ops.append(("clear", lambda: store.clear(), []))
    return ops


def part_url(rng: random.Random, tmp: Path, tally: Tally) -> None:
    from kvtc.errors import StoreError
    from kvtc.store import Store, open_store

    url = random_url(rng, tmp)
    t0 = time.perf_counter()
    violation = None
    try:
        store = call_with_timeout(lambda: open_store(url, NS), OP_TIMEOUT_S)
        outcome = f"url opened {type(store).__name__}"
        if not isinstance(store, Store):
            violation = ("wrong_type", f"open_store returned {store!r:.200}")
        elif type(store).__name__ != "RedisStore":  # never connect anywhere a random URL names
            ops_outcome, _, violation = run_ops(store, _ops(store))
            outcome += f", ops {ops_outcome}"
        store.close()
    except StoreError:
        outcome = "url StoreError"
    except Hung as e:
        outcome, violation = "hang", ("hang", str(e))
    except Exception as e:  # noqa: BLE001
        outcome = type(e).__name__
        violation = (
            "exception",
            f"open_store: {type(e).__name__}: {e}\n" + "".join(traceback.format_exception(type(e), e, e.__traceback__)),
        )
    tally.add("url", "url", outcome, time.perf_counter() - t0, repr(url), violation)


def part_resp(rng: random.Random, server: HostileServer, envelopes: list[bytes], tally: Tally) -> None:
    from kvtc.store import open_store
    from kvtc.store.redis import CALL_TIMEOUTS

    server.replies = [reply(rng, envelopes) for _ in range(rng.randrange(1, 4))]
    server.slots = slots_reply(rng, server.port)
    server.drip = drip = DRIP_S if rng.random() < 0.15 else 0.0
    scheme = rng.choice(["redis", "redis+cluster"])
    store = open_store(f"{scheme}://127.0.0.1:{server.port}?timeout={RESP_TIMEOUT_S}&retry_interval=0", NS)
    ops = _ops(store)  # clear() walks a whole keyspace, one timeout per batch: not bound by one call's time
    try:
        outcome, dt, violation = run_ops(store, ops)
        if violation is None:
            run_ops(store, [("clear", lambda: store.clear(), [])])
    finally:
        store.close()
        server.drip = 0.0
    bound = CALL_TIMEOUTS * RESP_TIMEOUT_S + SLOW_MARGIN_S
    if violation is None and dt > bound:
        outcome, violation = "slow", ("slow", f"a call took {dt:.2f} s, more than {bound:g} s")
    mutator = scheme + (" drip" if drip else "")
    what = repr([scheme, server.slots[:200], *(r[:300] for r in server.replies)])[:2000]
    tally.add("resp", mutator, f"resp ops {outcome}", dt, what, violation)


def part_redis(rng: random.Random, server: RealServer, client: Any, envelopes: list[bytes], tally: Tally) -> None:
    from kvtc.store import open_store, seal

    store = open_store(server.url + "?timeout=2", NS)
    keys = [f"k{i}" for i in range(rng.randrange(1, 5))]
    planted = [plant_redis(client, store.redis_key(k), rng, envelopes) for k in keys]
    kinds = [kind for kind, _ in planted]
    # the only hit allowed: an envelope sealed for this namespace and this very key (a truncation of one with a byte
    # appended, among the planted envelopes, can be exactly the envelope of a shorter payload: a legitimate entry)
    sealed = {seal(NS, k, p): (k, p) for k in keys for p in (b"payload", b"x")}
    expected = {
        k: sealed[data][1] if sealed.get(data, (None,))[0] == k else None for k, (_, data) in zip(keys, planted)
    }
    t0 = time.perf_counter()
    first: list = []
    try:
        outcome, dt, violation = run_ops(
            store,
            [("get_many", lambda: store.get_many(keys), keys)]
            + [("get", (lambda k=k: store.get(k)), []) for k in keys]
            + [("contains", (lambda k=k: store.contains(k)), []) for k in keys],
            first=first,
        )
        if violation is None and first[0] != expected:
            violation = ("wrong_hit", f"planted {kinds}: get_many gave {first[0]!r:.300}, expected {expected!r:.300}")
        if violation is None:
            ok = store.put_many({k: b"good" for k in keys})  # SET replaces a value of any type
            if ok != dict.fromkeys(keys, True) or store.get_many(keys) != dict.fromkeys(keys, b"good"):
                violation = ("not_replaced", f"put_many over planted {kinds} did not replace them: {ok}")
    finally:
        store.close()
    tally.add(
        "redis", "+".join(sorted(set(kinds))), f"redis ops {outcome}", time.perf_counter() - t0, repr(kinds), violation
    )


def _outside_state(tmp: Path) -> dict[str, bytes]:
    """Every file outside the store root that an input planted (what it holds)."""
    found = {}
    for p in [tmp / "outside", *sorted((tmp / "outside_tree").rglob("*"))]:
        if p.is_file() and not p.is_symlink():
            found[str(p.relative_to(tmp))] = p.read_bytes()
    return found


def part_file(rng: random.Random, tmp: Path, envelopes: list[bytes], tally: Tally) -> None:
    from kvtc.store import FileStore, entry_id

    root = tmp / "filestore"
    store = FileStore(root, NS, max_entry_bytes=FILE_MAX_ENTRY)
    keys = [f"k{i}" for i in range(rng.randrange(1, 4))]
    shards = [entry_id(NS, k)[:2] for k in keys]
    kinds = [plant_file(store, k, rng, tmp, envelopes, shards.count(s) > 1) for k, s in zip(keys, shards)]
    outside_before = _outside_state(tmp)

    def unblock() -> None:  # a reader blocked on a planted FIFO gets EOF
        for k in keys:
            p = store.path_of(k)
            try:
                fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
            except OSError:
                pass

    t0 = time.perf_counter()
    ops = (
        [("get_many", lambda: store.get_many(keys), keys)]
        + [("get", (lambda k=k: store.get(k)), []) for k in keys]
        + [("contains", (lambda k=k: store.contains(k)), []) for k in keys]
        + [
            ("stats", lambda: store.stats(), []),
            ("put_many", lambda: store.put_many({k: b"mine" for k in keys}), keys),
            ("delete", lambda: store.delete(keys[0]), []),
            ("sweep", lambda: store.sweep(tmp_grace=0), []),
        ]
    )
    first: list = []
    rss0 = reset_hwm()
    outcome, dt, violation = run_ops(store, ops, unblock, first=first)
    rss_growth = hwm() - rss0 if rss0 is not None else None
    expected = {k: b"payload" if kind in ("good", "tmp_link") else None for k, kind in zip(keys, kinds)}
    if violation is None and first[0] != expected:
        violation = ("wrong_hit", f"planted {kinds}: get_many gave {first[0]!r:.300}, expected {expected!r:.300}")
    if violation is None and _outside_state(tmp) != outside_before:
        violation = ("wrote_outside", f"planted {kinds}: a file outside the store root changed")
    if violation is None and rss_growth is not None and rss_growth > FILE_RSS_LIMIT:
        violation = ("memory", f"planted {kinds}: peak RSS grew by {rss_growth} bytes")
    store.close()
    for k in keys:  # links planted where shard directories belong would outlive this input
        _unplant_dirs(store.path_of(k))
    if (tmp / "outside").exists():
        (tmp / "outside").unlink()
    shutil.rmtree(tmp / "outside_tree", ignore_errors=True)
    tally.add(
        "file",
        "+".join(sorted(set(kinds))),
        f"file ops {outcome}",
        time.perf_counter() - t0,
        repr(kinds),
        violation,
        rss_growth,
    )


def run(runs: int, seed: int, real_server: bool = True) -> Tally:
    from kvtc.store import seal

    rng = random.Random(seed)
    tally = Tally("store", seed)
    envelopes = [
        seal(NS, "k0", b"payload"),
        seal(NS, "other", b"payload"),
        seal("other:ns", "k0", b"x"),
        seal(NS, "k0", b"x")[:-1],
        seal(NS, "k0", b"x") + b"\x00",
    ]
    try:
        import redis  # noqa: F401

        have_redis_py = True
    except ImportError:
        have_redis_py = False
        if real_server:
            tally.skipped.append("redis part: the redis Python package (to plant keys) is not installed")
    binary = shutil.which("redis-server")
    if real_server and have_redis_py and binary is None:
        tally.skipped.append("redis part: no redis-server on PATH")
    elif not real_server:
        tally.skipped.append("redis part: disabled (--no-real-server)")
    parts = ["url", "file", "resp"]  # the store speaks RESP itself: the resp part needs no redis package
    hostile = HostileServer()
    real = client = None
    old_cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="kvtc-fuzz-store-") as d:
        tmp = Path(d)
        work = tmp / "cwd"
        work.mkdir()
        os.chdir(work)  # a URL read as a relative path makes its directory here
        try:
            if real_server and have_redis_py and binary:
                import redis

                real = RealServer(binary, tmp)
                client = redis.Redis(host="127.0.0.1", port=real.port)
                parts.append("redis")
                tally.extra["redis_server"] = client.info("server").get("redis_version", "?")
            weights = {"url": 4, "file": 2, "resp": 3, "redis": 2}
            while tally.inputs < runs:
                part = rng.choices(parts, weights=[weights[p] for p in parts])[0]
                if part == "url":
                    part_url(rng, work, tally)
                elif part == "file":
                    part_file(rng, tmp, envelopes, tally)
                elif part == "resp":
                    part_resp(rng, hostile, envelopes, tally)
                else:
                    part_redis(rng, real, client, envelopes, tally)  # type: ignore[arg-type]
        finally:
            os.chdir(old_cwd)
            hostile.close()
            if real is not None:
                real.close()
    return tally


TARGET = (
    "open_store(url); get/put/contains/get_many/put_many/delete(/clear) on a hostile RESP server, a real "
    "redis-server's planted keys and a FileStore's planted entry paths"
)


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.getLogger("kvtc").setLevel(logging.CRITICAL)  # every refused entry logs a warning
    args = campaign_args(
        __doc__,
        1000,
        argv,
        lambda ap: ap.add_argument("--no-real-server", action="store_true", help="skip the real redis-server part"),
    )
    tally = run(args.runs, args.seed, real_server=not args.no_real_server)
    print(write_summary(tally.summary(TARGET, TIME_LIMIT_S, OP_TIMEOUT_S), args.out))
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
