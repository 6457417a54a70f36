"""Hostile input, round 2, Redis: servers on loopback that drip a valid reply a byte at a time, announce arrays
of ten million elements or bulk strings of gigabytes, answer ``CLUSTER SLOTS`` with a map of 16,384 nodes, or
name dozens of masters that accept connections and never answer. Whatever they do, one call of the store
returns (a miss, False) within about twice its ``timeout``, with bounded memory, and never raises.

Every server here binds 127.0.0.1 on an ephemeral port, runs in daemon threads whose loops end by themselves
(each has a lifetime, and stops when the test closes it), and closes its sockets."""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from kvtc.store import RedisStore, open_store, seal
from kvtc.store.redis_cluster import MAX_MASTERS, SLOTS, TopologyError, parse_cluster_slots
from kvtc.store.resp import MAX_ELEMENTS

NS = "model:calibration"
TIMEOUT = 0.5
#: What one call may take: twice the timeout, and a margin for a loaded machine.
BOUND = 2 * TIMEOUT + 0.5
LIFETIME = 60.0  # seconds a server lives at most, whatever the test does


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def _array(items: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(items) + b"".join(items)


class Server:
    """A TCP server on 127.0.0.1 whose connections are each served by ``handler(server, conn)`` in a daemon
    thread. Handlers use `recv_command` and `send`, which give up when the server stops or its lifetime ends."""

    def __init__(self, handler: Callable[[Server, socket.socket], None]) -> None:
        self.handler = handler
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.until = time.monotonic() + LIFETIME
        self.commands: list[list[bytes]] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    @property
    def running(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.until

    def _accept(self) -> None:
        with self.sock:
            while self.running:
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                self.threads.append(t)
                t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.05)
            try:
                self.handler(self, conn)
            except OSError:
                pass

    def recv_command(self, conn: socket.socket, buf: bytearray) -> list[bytes] | None:
        """The next command the client sent (None once it closed or the server stops)."""
        while self.running:
            parsed = _parse_command(buf)
            if parsed is not None:
                self.commands.append(parsed)
                return parsed
            try:
                data = conn.recv(1 << 16)
            except TimeoutError:
                continue
            if not data:
                return None
            buf += data
        return None

    def send(self, conn: socket.socket, data: bytes) -> bool:
        view = memoryview(data)
        while view and self.running:
            try:
                view = view[conn.send(view) :]
            except TimeoutError:
                continue
        return not view

    def idle(self, conn: socket.socket) -> None:
        """Keep the connection open and never answer, until the server stops."""
        while self.running:
            try:
                if not conn.recv(1 << 16):
                    return
            except TimeoutError:
                continue

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(2)
        assert not any(t.is_alive() for t in self.threads)


def _parse_command(buf: bytearray) -> list[bytes] | None:
    """Take one RESP command off the front of `buf` (None until it is whole)."""
    if not buf.startswith(b"*") or b"\r\n" not in buf:
        return None
    end = buf.index(b"\r\n")
    pos, args = end + 2, []
    for _ in range(int(buf[1:end])):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        n = int(buf[pos + 1 : end])
        if len(buf) < end + 2 + n + 2:
            return None
        args.append(bytes(buf[end + 2 : end + 2 + n]))
        pos = end + 2 + n + 2
    del buf[:pos]
    return args


class SilentMasters:
    """`n` listeners on 127.0.0.1 that accept every connection and never answer (one selector thread)."""

    def __init__(self, n: int) -> None:
        self.listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
        self.ports = [s.getsockname()[1] for s in self.listeners]
        self.accepted: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        until = time.monotonic() + LIFETIME
        with selectors.DefaultSelector() as sel:
            for s in self.listeners:
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
            while not self.stop.is_set() and time.monotonic() < until:
                for key, _ in sel.select(0.05):
                    try:
                        conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                        self.accepted.append(conn)
                    except OSError:
                        pass
        for s in self.listeners + self.accepted:
            s.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        assert not self.thread.is_alive()


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(handler: Callable[[Server, socket.socket], None]) -> Server:
        servers.append(Server(handler))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _store(port: int, scheme: str = "redis", query: str = "") -> RedisStore:
    store = open_store(f"{scheme}://127.0.0.1:{port}?timeout={TIMEOUT}&retry_interval=0{query}", NS)
    assert isinstance(store, RedisStore)
    return store


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.monotonic()
    value = fn()
    return value, time.monotonic() - t0


def _peak(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- one server ------------------------------------------------------------------------------


def _answer_each(reply: Callable[[list[bytes]], bytes], drip: float = 0.0) -> Callable[[Server, socket.socket], None]:
    """A handler answering each command with ``reply(command)``, all at once or one byte every `drip` s."""

    def handler(server: Server, conn: socket.socket) -> None:
        buf = bytearray()
        while (command := server.recv_command(conn, buf)) is not None:
            data = reply(command)
            if not drip:
                server.send(conn, data)
                continue
            for i in range(len(data)):
                if not server.running or not server.send(conn, data[i : i + 1]):
                    return
                server.stop.wait(drip)

    return handler


def test_slow_drip_costs_one_timeout(serve) -> None:
    """A valid 64-byte GET reply (an entry of this very key) sent one byte every 100 ms: the old client's
    per-receive timeout never fired and a get took the whole 6.4 s drip (40-45 s for larger replies)."""
    entry = seal(NS, "k", b"x" * (64 - len(seal(NS, "k", b""))))
    assert len(entry) == 64
    reply = _bulk(entry)  # to every command: a get's hit, were it on time
    server = serve(_answer_each(lambda c: reply, drip=0.1))
    store = _store(server.port)
    for call in (lambda: store.get("k"), lambda: store.put("k", b"v"), lambda: store.get_many(["k", "j"])):
        value, seconds = _timed(call)
        assert value in (None, False, {"k": None, "j": None}) and seconds < BOUND, (value, seconds)
        assert seconds > TIMEOUT * 0.8  # it did wait for the server, once
    assert store.stats()["errors"] == 4 and store.stats()["hits"] == 0


@pytest.mark.parametrize("speed", ["fast", "slow"])
def test_ten_million_element_array_is_refused_at_its_header(serve, speed: str) -> None:
    def handler(server: Server, conn: socket.socket) -> None:
        buf = bytearray()
        if server.recv_command(conn, buf) is None:
            return
        server.send(conn, b"*10000000\r\n")
        chunk = b":1\r\n" * (1 << 14)
        for _ in range(10_000_000 // (1 << 14) + 1):  # the elements, until the client hangs up
            if not server.send(conn, chunk if speed == "fast" else chunk[:4]):
                return
            if speed == "slow":
                server.stop.wait(0.01)

    server = serve(handler)
    store = _store(server.port)
    value, seconds = _timed(lambda: store.get("k"))
    assert value is None and seconds < BOUND, seconds
    assert _peak(lambda: store.get("k")) < 1 << 20
    assert _timed(lambda: store.put("k", b"v"))[1] < BOUND


def test_wide_arrays_within_the_array_bound_are_refused_by_the_element_bound(serve) -> None:
    row = _array([b":1\r\n"] * 60_000)
    reply = _array([row] * (MAX_ELEMENTS // 60_000 + 1))
    server = serve(_answer_each(lambda c: reply))
    store = _store(server.port)
    value, seconds = _timed(lambda: store.get("k"))
    assert value is None and seconds < BOUND, seconds


@pytest.mark.parametrize("declared", [600 << 20, 10 << 30])
def test_huge_bulk_string_is_refused_at_its_header(serve, declared: int, caplog: pytest.LogCaptureFixture) -> None:
    """A GET reply declaring more than max_entry_bytes (default 512 MiB) and then streaming bytes fast: refused
    before any of them is kept."""

    header, zeros = b"$%d\r\n" % declared, bytes(1 << 20)  # built once: tracemalloc sees the server's thread

    def handler(server: Server, conn: socket.socket) -> None:
        buf = bytearray()
        while server.recv_command(conn, buf) is not None:
            server.send(conn, header)
            for _ in range(64):
                if not server.send(conn, zeros):
                    return

    server = serve(handler)
    store = _store(server.port)
    assert _peak(lambda: store.get("k")) < 1 << 20  # the old client gathered the 64 MiB sent
    with caplog.at_level(logging.WARNING, logger="kvtc.store"):
        value, seconds = _timed(lambda: store.get("k"))
    assert value is None and seconds < BOUND and "more than the 536870912 accepted" in caplog.text


def test_configured_max_entry_bytes_bounds_replies_and_writes(serve) -> None:
    reply = _bulk(seal(NS, "k", bytes(2 << 20)))  # built once: tracemalloc sees the server's thread too
    server = serve(_answer_each(lambda c: reply if c[0].upper() == b"GET" else b"+OK\r\n"))
    small = _store(server.port, query="&max_entry_bytes=1MiB")
    assert small.max_entry_bytes == 1 << 20
    assert _peak(lambda: small.get("k")) < 512 << 10 and small.get("k") is None
    assert small.put("k", bytes(2 << 20)) is False and small.put("k", bytes(100)) is True
    big = _store(server.port, query="&max_entry_bytes=4MiB")
    assert big.get("k") == bytes(2 << 20)  # the same reply, under the limit: a hit


def test_deep_nesting_is_refused(serve) -> None:
    server = serve(_answer_each(lambda c: b"*1\r\n" * 1_000_000 + b":1\r\n"))
    value, seconds = _timed(lambda: _store(server.port).get("k"))
    assert value is None and seconds < BOUND


# -- clusters --------------------------------------------------------------------------------


def _slot_map(masters: list[int]) -> bytes:
    """A CLUSTER SLOTS reply splitting the slots evenly over 127.0.0.1:<port> for each port of `masters`."""
    n = len(masters)
    ranges = []
    for i, port in enumerate(masters):
        first, last = i * SLOTS // n, (i + 1) * SLOTS // n - 1
        if first <= last:
            node = _array([_bulk(b"127.0.0.1"), b":%d\r\n" % port, _bulk(b"%040x" % port)])
            ranges.append(_array([b":%d\r\n" % first, b":%d\r\n" % last, node]))
    return _array(ranges)


def _cluster_seed(slot_map: bytes, answer_once: bool = False) -> Callable[[Server, socket.socket], None]:
    """A seed node answering CLUSTER SLOTS / CLUSTER SHARDS with `slot_map` (only the first time, then nothing
    at all, with `answer_once`), a command on a key with a redirection to its own port, and a client's handshake
    as a RESP2 server would."""
    answered = threading.Event()

    def handler(server: Server, conn: socket.socket) -> None:
        buf = bytearray()
        while (command := server.recv_command(conn, buf)) is not None:
            name = command[0].upper()
            if answer_once and answered.is_set():
                return server.idle(conn)
            if name == b"CLUSTER":
                answered.set()
                server.send(conn, slot_map)
            elif name in (b"GET", b"SET", b"EXISTS", b"DEL", b"WATCH", b"SCAN"):
                server.send(conn, b"-MOVED 1 127.0.0.1:%d\r\n" % server.port)
            elif name == b"HELLO":  # a RESP2 server, as far as redis-py's handshake is concerned
                server.send(conn, b"-ERR unknown command 'HELLO'\r\n")
            else:
                server.send(conn, b"+OK\r\n")

    return handler


def test_map_of_16384_nodes_is_refused(serve) -> None:
    """Every slot on its own master, 16,384 of them: the old store made a client for each and took 18 s."""
    slot_map = _slot_map(list(range(20_000, 20_000 + SLOTS)))
    assert slot_map.count(b"127.0.0.1") == SLOTS
    server = serve(_cluster_seed(slot_map))
    store = _store(server.port, "redis+cluster")
    keys = [f"k{i}" for i in range(50)]
    for call in (lambda: store.get("k"), lambda: store.get_many(keys), lambda: store.put("k", b"v")):
        value, seconds = _timed(call)
        assert value in (None, False, dict.fromkeys(keys)) and seconds < BOUND, (value, seconds)
    assert len(store._nodes) == 1 and store._slots is None  # no node of the map was kept
    with pytest.raises(TopologyError, match="more than 1000 masters"):
        parse_cluster_slots(_parse_reply(slot_map), "127.0.0.1")


def test_thousand_masters_are_accepted() -> None:
    ranges = _parse_reply(_slot_map(list(range(20_000, 20_000 + MAX_MASTERS))))
    assert len({(h, p) for _, _, h, p in parse_cluster_slots(ranges, "127.0.0.1")}) == MAX_MASTERS


def _parse_reply(data: bytes):
    from kvtc.store.resp import Connection, Limits

    a, b = socket.socketpair()
    with a, b:
        conn = Connection(a, Limits(max_bulk=1 << 20))
        conn._buf += data
        return conn.read_reply(time.monotonic() + 10)


@pytest.mark.parametrize("answer_once", [True, False])
def test_slot_map_of_silent_masters_costs_at_most_two_timeouts_a_call(serve, answer_once: bool) -> None:
    """A seed answers CLUSTER SLOTS with a map of 60 masters that accept connections and never answer (with
    `answer_once`, the seed then falls silent too). The old store re-read the map from every node it knew after
    each failure, one timeout each: (60 + 1) x 0.5 s = 30 s for one get."""
    silent = SilentMasters(60)
    try:
        server = serve(_cluster_seed(_slot_map(silent.ports), answer_once=answer_once))
        store = _store(server.port, "redis+cluster")
        keys = [f"chunk-{i}" for i in range(120)]
        worst = 0.0
        for call in [lambda k=k: store.get(k) for k in keys[:6]] + [
            lambda: store.get_many(keys),
            lambda: store.put_many(dict.fromkeys(keys, b"v")),
            lambda: store.get("again"),
        ]:
            value, seconds = _timed(call)
            assert value in (None, dict.fromkeys(keys), dict.fromkeys(keys, False)), value
            worst = max(worst, seconds)
        assert worst < BOUND, worst
        assert len(store._nodes) <= 61
    finally:
        silent.close()


def test_tls_handshake_that_never_completes_costs_one_timeout() -> None:
    """rediss:// to a server that accepts the connection and never answers the TLS client hello."""
    silent = SilentMasters(1)
    try:
        store = _store(silent.ports[0], "rediss")
        for call in (lambda: store.get("k"), lambda: store.put("k", b"v")):
            value, seconds = _timed(call)
            assert value in (None, False) and TIMEOUT * 0.8 < seconds < BOUND, (value, seconds)
    finally:
        silent.close()


# -- the store's own client, against a real server -------------------------------------------


@pytest.mark.redis
def test_tls_auth_and_database_against_a_real_server(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The RESP client that replaced redis-py still speaks to a real server: TLS (certificate and host checked),
    AUTH with and without a user name, SELECT; a wrong password is a miss."""
    import shutil
    import subprocess

    from redis_server import free_port, redis_server_binary

    binary, openssl = redis_server_binary(), shutil.which("openssl")
    if binary is None or openssl is None:
        pytest.skip("needs redis-server (scripts/ensure_redis.sh) and openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1"]
        + ["-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    port = free_port()
    argv = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    argv += ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert)]
    argv += ["--tls-auth-clients", "no", "--requirepass", "s3cret", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the default context trusts this self-signed certificate
        url = f"rediss://{{}}@127.0.0.1:{port}/{{}}?timeout=2"
        store = open_store(url.format(":s3cret", 2), NS)
        deadline = time.monotonic() + 10
        while not store.put("k", b"v") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.get("k") == b"v" and open_store(url.format("default:s3cret", 2), NS).get("k") == b"v"
        assert open_store(url.format(":s3cret", 3), NS).get("k") is None  # another database
        wrong = open_store(url.format(":nope", 2), NS)
        assert wrong.get("k") is None and wrong.stats()["errors"] == 1
        monkeypatch.delenv("SSL_CERT_FILE")
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "none.pem"))
        untrusted = open_store(url.format(":s3cret", 2), NS)  # the certificate is checked
        assert untrusted.get("k") is None and untrusted.stats()["errors"] == 1
    finally:
        process.terminate()
        process.wait(10)
