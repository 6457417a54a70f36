"""Bytes of tensors on the host and the device, and streams held in pieces.

The container stores every number little-endian. Host tensors are turned into little-endian bytes
(:func:`le_bytes`) and parsed back (:func:`from_le`); CUDA devices are little-endian, so a device tensor's bytes
are viewed as they lie (:func:`device_bytes`) and a section decoded on the device is viewed back as a tensor
(:func:`section_tensor`).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import FormatError

#: the streams of a pinned uint8 host tensor: ``(tensor, byte offset of each stream)``
Pinned = tuple[torch.Tensor, Sequence[int]]


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
    "Parts",
    "PinnedScratch",
    "align",
    "new_bytes",
    "device_bytes",
    "from_le",
    "host_bytes",
    "le_bytes",
    "section_tensor",
]
