"""A small RESP2 client for `RedisStore`, written for servers that may be hostile.

Every exchange with a server (connect, TLS handshake, AUTH/SELECT, sending the commands, reading every reply)
runs against one absolute deadline on the monotonic clock: each system call is given the time left, and the
reader checks the clock as it parses, so a server that drips its reply a byte at a time, never answers, or
sends more than it may costs at most the time left, never more. Replies are bounded before anything is built
from them: a bulk string's declared length against ``Limits.max_bulk`` (the store's largest entry; the bytes are
gathered as they arrive, not allocated from the header), arrays by length, nesting depth and total elements
per reply, and every line (status, error, integer, header) by length. A reply past a bound raises
`ProtocolError` and the connection is dropped, never reused half-read.

Replies: bulk string -> ``bytes``, nil -> ``None``, integer -> ``int``, array -> ``list``, status (``+OK``)
-> `Status` (a ``bytes``), error (``-ERR ...``) -> a `ReplyError` *value* in its place (the store decides
what an error means for each key).
"""

from __future__ import annotations

import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..textsafe import printable

#: Elements of one array, arrays nested in one reply, and elements of all the arrays of one reply. A cluster
#: slot map of 16,384 one-slot ranges, each with a master and a replica, fits all three.
MAX_ARRAY = 65_536
MAX_DEPTH = 8
MAX_ELEMENTS = 300_000
#: Bytes of one line: a status, an error, an integer or a header.
MAX_LINE = 64 << 10
#: Idle connections kept per server.
MAX_IDLE = 8
_RECV = 1 << 16
_BIG_RECV = 1 << 20
_NUMBER = re.compile(rb"-?[0-9]{1,20}")


class ProtocolError(ConnectionError):
    """A reply that is not RESP2, or past a bound; the connection it came on is dropped."""


class ReplyTooLarge(ProtocolError):
    """A bulk string longer than ``Limits.max_bulk`` (an entry larger than the store accepts)."""


class DeadlineExceeded(TimeoutError):
    """The exchange's deadline passed before the server had answered in full."""


class Status(bytes):
    """A status reply, such as ``+OK``."""


class ReplyError(Exception):
    """An error reply, returned in place of the command's reply (it is not raised by `Connection.exchange`)."""

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    @property
    def redirect(self) -> bool:
        """A cluster redirection (``MOVED slot host:port`` or ``ASK slot host:port``)."""
        return self.message.startswith(("MOVED ", "ASK "))


@dataclass(frozen=True)
class Limits:
    max_bulk: int
    max_array: int = MAX_ARRAY
    max_depth: int = MAX_DEPTH
    max_elements: int = MAX_ELEMENTS
    max_line: int = MAX_LINE


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the server did not answer in time")
    return left


def encode(command: Sequence[Any]) -> list[bytes | memoryview]:
    """A command as RESP2 pieces (big arguments stay separate, so that a large value is not copied)."""
    pieces: list[bytes | memoryview] = [b"*%d\r\n" % len(command)]
    for arg in command:
        if isinstance(arg, str):
            arg = arg.encode("utf-8", "surrogatepass")
        elif isinstance(arg, int) and not isinstance(arg, bool):
            arg = b"%d" % arg
        elif not isinstance(arg, (bytes, bytearray, memoryview)):
            raise TypeError(f"a Redis command argument must be str, int or bytes, not {type(arg).__name__}")
        view = memoryview(arg).cast("B")
        pieces += [b"$%d\r\n" % len(view), view, b"\r\n"]
    return pieces


class Connection:
    """One socket to one server; not shared between threads."""

    def __init__(self, sock: socket.socket, limits: Limits) -> None:
        self.sock = sock
        self.limits = limits
        self._buf = bytearray()
        self._pos = 0
        self._steps = 0

    @classmethod
    def open(cls, host: str, port: int, deadline: float, limits: Limits, tls: ssl.SSLContext | None) -> Connection:
        """Connect (and shake hands over TLS) before `deadline`."""
        last: OSError | None = None
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[:4]:
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(_left(deadline))
                sock.connect(address)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if tls is not None:
                    sock = _handshake(
                        tls.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False), deadline
                    )
                return cls(sock, limits)
            except DeadlineExceeded:
                sock.close()
                raise
            except OSError as e:
                sock.close()
                last = e
        raise last or ConnectionError(f"no address for {printable(host)}")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # -- sending -----------------------------------------------------------------------------

    def send(self, commands: Sequence[Sequence[Any]], deadline: float) -> None:
        batch: list[bytes | memoryview] = []
        size = 0
        for command in commands:
            for piece in encode(command):
                if len(piece) >= _RECV:  # a large value goes out as it is, after what came before it
                    self._sendall(b"".join(batch), deadline)
                    self._sendall(piece, deadline)
                    batch, size = [], 0
                else:
                    batch.append(piece)
                    size += len(piece)
                    if size >= _RECV:
                        self._sendall(b"".join(batch), deadline)
                        batch, size = [], 0
        if batch:
            self._sendall(b"".join(batch), deadline)

    def _sendall(self, data: bytes | memoryview, deadline: float) -> None:
        view = memoryview(data)
        while view:  # the socket's timeout bounds each call; the deadline bounds them all
            self.sock.settimeout(_left(deadline))
            view = view[self.sock.send(view) :]

    def exchange(self, commands: Sequence[Sequence[Any]], deadline: float) -> list[Any]:
        """Send `commands` as one pipeline and read one reply for each, all before `deadline`."""
        self.send(commands, deadline)
        return [self.read_reply(deadline) for _ in commands]

    # -- reading -----------------------------------------------------------------------------

    def _fill(self, deadline: float, size: int = _RECV) -> bytes:
        self.sock.settimeout(_left(deadline))
        data = self.sock.recv(size)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data

    def _line(self, deadline: float) -> bytes:
        self._steps += 1
        if not self._steps & 1023:  # parsing what is already buffered is bounded by the deadline too
            _left(deadline)
        start = self._pos
        while True:
            end = self._buf.find(b"\r\n", start)
            if end >= 0:
                line = bytes(self._buf[self._pos : end])
                self._pos = end + 2
                return line
            if len(self._buf) - self._pos > self.limits.max_line:
                raise ProtocolError(f"a reply line longer than {self.limits.max_line} bytes")
            start = max(self._pos, len(self._buf) - 1)
            if self._pos:
                del self._buf[: self._pos]
                start -= self._pos
                self._pos = 0
            self._buf += self._fill(deadline)

    def _bulk(self, n: int, deadline: float) -> bytes:
        need = n + 2
        have = len(self._buf) - self._pos
        if have >= need:
            data = self._buf[self._pos : self._pos + need]
            self._pos += need
        else:  # gathered as it arrives: memory follows what the server sent, not what it declared
            data = self._buf[self._pos :]
            self._buf, self._pos = bytearray(), 0
            while len(data) < need:
                data += self._fill(deadline, min(need - len(data), _BIG_RECV))
        if data[n:] != b"\r\n":
            raise ProtocolError("a bulk string not followed by CRLF")
        del data[n:]
        return bytes(data)

    def _number(self, text: bytes, what: str) -> int:
        if not _NUMBER.fullmatch(text):
            raise ProtocolError(f"{what} {printable(text[:40])!r} is not an integer")
        return int(text)

    def read_reply(self, deadline: float) -> Any:
        """One whole reply, within the limits and before `deadline` (iterative: no recursion on nesting)."""
        limits = self.limits
        stack: list[tuple[list[Any], int]] = []  # arrays being filled, and the length each will have
        elements = 0
        while True:
            line = self._line(deadline)
            kind, rest = line[:1], line[1:]
            value: Any
            if kind == b"$":
                n = self._number(rest, "bulk length")
                if n > limits.max_bulk:
                    raise ReplyTooLarge(f"a bulk string of {n} bytes, more than the {limits.max_bulk} accepted")
                if n < -1:
                    raise ProtocolError(f"bulk length {n}")
                value = None if n == -1 else self._bulk(n, deadline)
            elif kind == b"+":
                value = Status(rest)
            elif kind == b"-":
                value = ReplyError(printable(rest.decode("utf-8", "replace"), 500))
            elif kind == b":":
                value = self._number(rest, "integer")
            elif kind == b"*":
                n = self._number(rest, "array length")
                if n < -1 or n > limits.max_array:
                    raise ProtocolError(f"an array of {n} elements (at most {limits.max_array} accepted)")
                if n > 0:
                    elements += n
                    if len(stack) >= limits.max_depth:
                        raise ProtocolError(f"a reply nested deeper than {limits.max_depth} arrays")
                    if elements > limits.max_elements:
                        raise ProtocolError(f"a reply of more than {limits.max_elements} elements")
                    stack.append(([], n))
                    continue
                value = None if n == -1 else []
            else:
                raise ProtocolError(f"reply type {printable(kind)!r} is not RESP2")
            while stack:
                items, n = stack[-1]
                items.append(value)
                if len(items) < n:
                    break
                stack.pop()
                value = items
            else:
                return value


def _handshake(sock: ssl.SSLSocket, deadline: float) -> ssl.SSLSocket:
    sock.setblocking(False)
    while True:
        try:
            sock.do_handshake()
            break
        except ssl.SSLWantReadError:
            select.select([sock], [], [], _left(deadline))
        except ssl.SSLWantWriteError:
            select.select([], [sock], [], _left(deadline))
    sock.setblocking(True)
    return sock


class ConnectionPool:
    """Connections to one server, opened on demand (AUTH and SELECT first), at most `MAX_IDLE` kept idle."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        limits: Limits,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.connection_kwargs = {"host": host, "port": port, "db": db, "username": username, "password": password}
        self._limits = limits
        self._tls = tls
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def get(self, deadline: float) -> Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        kw = self.connection_kwargs
        conn = Connection.open(kw["host"], kw["port"], deadline, self._limits, self._tls)
        try:
            hello: list[tuple[Any, ...]] = []
            if kw["password"] is not None:
                hello.append(("AUTH", *([kw["username"]] if kw["username"] else []), kw["password"]))
            if kw["db"]:
                hello.append(("SELECT", kw["db"]))
            for command, reply in zip(hello, conn.exchange(hello, deadline) if hello else []):
                if not isinstance(reply, Status):
                    raise ProtocolError(f"the server answered {command[0]} with {printable(repr(reply), 200)}")
        except BaseException:
            conn.close()
            raise
        return conn

    def release(self, conn: Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE and conn._pos == len(conn._buf):
                self._idle.append(conn)
                return
        conn.close()

    def disconnect(self, close: bool = False) -> None:
        """Close the idle connections (and, with `close`, every one released from now on)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = self._closed or close
        for conn in idle:
            conn.close()


class RespClient:
    """Pipelines to one server, each over a pooled connection and within one deadline."""

    def __init__(self, host: str, port: int, **kwargs: Any) -> None:
        self.connection_pool = ConnectionPool(host, port, **kwargs)

    @contextmanager
    def connection(self, deadline: float) -> Iterator[Connection]:
        """A connection for several exchanges; dropped if anything fails (a half-read reply is never reused)."""
        conn = self.connection_pool.get(deadline)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        self.connection_pool.release(conn)

    def pipeline(self, commands: Sequence[Sequence[Any]], deadline: float) -> list[Any]:
        with self.connection(deadline) as conn:
            return conn.exchange(commands, deadline)

    def execute(self, *command: Any, deadline: float) -> Any:
        return self.pipeline([command], deadline)[0]

    def close(self) -> None:
        self.connection_pool.disconnect(close=True)
