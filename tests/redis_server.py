"""A real, throwaway redis-server for tests and benchmarks: 127.0.0.1, a free port, a temp dir.

    with RedisServer() as server:
        url = server.url            # redis://127.0.0.1:<port>/0
        server.stop(); server.start()  # same port, empty data

Pytest fixtures (import them into a test module): `redis_server`, one server per test module;
`redis_url`, that server emptied before each test; `own_redis_server`, a server the test may stop.
Tests using them skip, saying why, only when no redis-server binary exists;
``scripts/ensure_redis.sh`` installs one.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

STARTUP_TIMEOUT_S = 10.0


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.access(p, os.X_OK)), None
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process without persistence, bound to 127.0.0.1."""

    def __init__(self, port: int | None = None) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("no redis-server binary on PATH; run scripts/ensure_redis.sh")
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvtc-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.process is not None:
            return
        for attempt in range(5):
            self.process = subprocess.Popen(
                [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir,
                 "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes",
                 "--logfile", os.path.join(self.dir, "redis.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return
            self.process.kill()
            self.process.wait()
            self.process = None
            self.port = free_port()  # the port was taken between probing and binding
        raise RuntimeError(f"redis-server did not start; see {self.dir}/redis.log")

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

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
