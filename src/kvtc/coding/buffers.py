"""Bytes of tensors on the host and the device, and streams held in pieces.

The container stores every number little-endian. Host tensors are turned into little-endian bytes
(:func:`le_bytes`) and parsed back (:func:`from_le`); CUDA devices are little-endian, so a device tensor's bytes
are viewed as they lie (:func:`device_bytes`) and a section decoded on the device is viewed back as a tensor
(:func:`section_tensor`).
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import FormatError

#: the streams of a pinned uint8 host tensor: ``(tensor, byte offset of each stream)``
Pinned = tuple[torch.Tensor, Sequence[int]]


#: float32 bytes of the rows a CPU decode reconstructs at once (a chunk of a PCA group's middle rows, of a span's
#: token-map predictions) in a decode of up to 32 times this: what its intermediates take stays near a few times this
CHUNK_BYTES = 4 << 20
#: a larger decode's chunks grow with it (a share of its decoded bytes: fewer, larger operations), up to this
MAX_CHUNK_BYTES = 32 << 20
#: the fewest rows one product of a chunk spans (unless there are fewer in all): MKL multiplies a few rows with other
#: kernels, which round differently; from this many on, every row gets the bits one product of all the rows gives it
#: (checked for 1-32 threads), so a chunked decode is bit for bit the decode of one product
MIN_CHUNK_ROWS = 256


def chunk_bytes(decoded: int, share: int = 32) -> int:
    """Bytes of a chunk in a decode of ``decoded`` bytes: :data:`CHUNK_BYTES`, or ``1/share`` of the decode, up to
    :data:`MAX_CHUNK_BYTES`."""
    return min(max(CHUNK_BYTES, decoded // share), max(MAX_CHUNK_BYTES, CHUNK_BYTES))


def chunk_rows(row_bytes: int, chunk: int | None = None) -> int:
    """Rows per chunk of rows of ``row_bytes`` each: ``chunk`` bytes of them (default :data:`CHUNK_BYTES`), a
    multiple of 64, at least :data:`MIN_CHUNK_ROWS`."""
    return max(MIN_CHUNK_ROWS, (chunk or CHUNK_BYTES) // max(row_bytes, 1) // 64 * 64)


def row_chunks(n: int, step: int, least: int = MIN_CHUNK_ROWS) -> list[tuple[int, int]]:
    """``[r0, r1)`` ranges of ``step`` rows covering ``n`` rows, a short last one (under ``least`` rows) joined to
    the one before it."""
    cuts = list(range(0, n, max(step, 1)))
    if len(cuts) > 1 and n - cuts[-1] < least:
        cuts.pop()
    return list(zip(cuts, cuts[1:] + [n]))


class Scratch:
    """Buffers a chunked decode reuses from one chunk to the next, each kept at the largest size asked for: its
    intermediates are allocated once, not once a chunk. (glibc serves blocks of a few MiB from its heap once it has
    freed one that large, and keeps what is freed there: chunks' allocations of varying sizes fragment it, and the
    resident memory then grows chunk after chunk.) A buffer's contents last until it is asked for again."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, Any] = {}

    def numpy(self, name: str, shape: tuple[int, ...], dtype: Any, least: int = 0) -> np.ndarray:
        """An uninitialised ``shape`` array of ``dtype`` (``least``: elements to reserve at once), in memory torch
        allocates, as it does the decode's other buffers (numpy's own allocations are traced as Python memory)."""
        dtype = np.dtype(dtype)
        size = int(np.prod(shape))
        key = (name, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.size < size:
            self._bufs.pop(key, None)
            raw = torch.empty(max(size, least, 1) * dtype.itemsize, dtype=torch.uint8).numpy()
            buf = self._bufs[key] = raw.view(dtype)
        return buf[:size].reshape(shape)

    def tensor(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, least: int = 0
    ) -> torch.Tensor:
        """An uninitialised ``shape`` tensor of ``dtype`` on ``device`` (``least``: elements to reserve at once)."""
        size = int(np.prod(shape))
        key = (name, dtype, str(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < size:
            self._bufs.pop(key, None)
            buf = self._bufs[key] = torch.empty(max(size, least), dtype=dtype, device=device)
        return buf[:size].view(shape)


def align(n: int, a: int = 16) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a


class Parts:
    """A coded stream held as consecutive buffers (e.g. a small header in bytes and the payload still in a
    pinned host buffer), joined only when the container is assembled: one copy instead of two."""

    def __init__(self, buffers: list[bytes | memoryview]):
        self.buffers = [memoryview(b).cast("B") for b in buffers]
        self.nbytes = sum(len(b) for b in self.buffers)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.buffers)


def le_bytes(t: torch.Tensor) -> bytes:
    """Little-endian bytes of a tensor (the container's byte order on every host)."""
    t = t.detach().contiguous().cpu()
    if t.dtype in (torch.bfloat16,):
        a = t.view(torch.int16).numpy()
    else:
        a = t.numpy()
    return a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def device_bytes(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's bytes as flat uint8 (CUDA devices are little-endian: the container's order)."""
    return t.contiguous().view(torch.uint8).reshape(-1)


def host_bytes(t: torch.Tensor) -> bytes:
    """A device tensor's bytes on the host (through pinned memory where CUDA is present)."""
    host = torch.empty(t.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    host.copy_(t.reshape(-1))
    return host.numpy().tobytes()


def section_tensor(
    data: bytes | torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """A decoded section as a tensor on ``device``: host bytes are parsed little-endian, device bytes viewed."""
    if isinstance(data, torch.Tensor):
        count = int(np.prod(shape)) if shape else 1
        esize = torch.empty((), dtype=dtype).element_size()
        if data.numel() != count * esize:
            raise FormatError(f"section holds {data.numel()} bytes, {count * esize} expected")
        return data.view(dtype).reshape(shape).to(device)
    return from_le(data, dtype, shape).to(device)


def section_view(
    data: bytes | torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """:func:`section_tensor` without a copy where one is not needed: host bytes on a little-endian host, wanted on
    the CPU, are viewed in place (:func:`host_view`). The result may share the section's memory: read it, never
    write it."""
    if isinstance(data, torch.Tensor) or device.type != "cpu":
        return section_tensor(data, dtype, shape, device)
    return host_view(data, dtype, shape)


def host_view(data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor of ``dtype`` and ``shape`` over little-endian bytes (exactly that many): their memory itself on a
    little-endian host (read-only: never write it), else a parsed copy (:func:`from_le`)."""
    esize = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape)) if shape else 1
    if len(memoryview(data).cast("B")) != count * esize:
        raise FormatError(f"section holds {len(memoryview(data).cast('B'))} bytes, {count * esize} expected")
    if sys.byteorder != "little":
        return from_le(data, dtype, shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # the buffer is read-only (bytes): the tensor is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype).view(shape)


def from_le(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor of ``dtype`` and ``shape`` parsed from little-endian bytes (exactly that many)."""
    view_as = {torch.bfloat16: torch.int16}.get(dtype, dtype)
    np_dtype = torch.empty((), dtype=view_as).numpy().dtype.newbyteorder("<")
    count = int(np.prod(shape)) if shape else 1
    if len(data) != count * np_dtype.itemsize:
        raise FormatError(f"section holds {len(data)} bytes, {count * np_dtype.itemsize} expected")
    a = np.frombuffer(data, dtype=np_dtype).astype(np_dtype.newbyteorder("="), copy=True)
    t = torch.from_numpy(a).reshape(shape)
    return t.view(dtype) if view_as is not dtype else t


def new_bytes(n: int) -> tuple[bytes, np.ndarray] | None:
    """A new ``bytes`` object of ``n`` bytes and a writable uint8 array over its contents, to be filled before
    the object is shared (CPython's ``PyBytes_FromStringAndSize(NULL, n)`` contract: a fresh object's contents may
    be written until it is handed out). Lets a large result be written once, by several threads, instead of
    assembled elsewhere and copied into a ``bytes``. None where the interpreter offers no such object."""
    if sys.implementation.name != "cpython" or n <= 0:
        return None
    api = ctypes.pythonapi
    make = api.PyBytes_FromStringAndSize
    make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
    addr = api.PyBytes_AsString
    addr.restype, addr.argtypes = ctypes.c_void_p, [ctypes.py_object]
    obj = make(None, n)
    view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr(obj)))
    return obj, view


class PinnedScratch:
    """A pinned host buffer kept and grown for reuse (fresh pinned or pageable pages cost a fault each)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def get(self, n: int) -> torch.Tensor:
        """A uint8 CPU tensor of at least ``n`` bytes (pinned where CUDA is present); its first ``n`` returned."""
        if self.buf is None or self.buf.numel() < n:
            self.buf = None
            self.buf = torch.empty(align(max(n, 1), 1 << 20), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self.buf[:n]


__all__ = [
    "CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_ROWS",
    "Parts",
    "PinnedScratch",
    "Scratch",
    "align",
    "chunk_bytes",
    "chunk_rows",
    "new_bytes",
    "row_chunks",
    "device_bytes",
    "from_le",
    "host_bytes",
    "host_view",
    "le_bytes",
    "section_tensor",
    "section_view",
]
