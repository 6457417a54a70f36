"""Lossless entropy coders behind one interface, and their one registry.

Every coder follows :class:`EntropyCoder`: ``encode`` turns a batch of payloads into coded streams and
``decode`` turns coded streams back into exactly their declared sizes (``raw_len`` comes from the validated
container header, so a malicious stream cannot make a decoder allocate without bound). A host coder
(:class:`Backend`) codes bytes on the CPU; a GPU coder codes uint8 device tensors and decodes into them. What
one coder of a backend writes, every coder of that backend reads, on any machine.

:data:`BACKENDS` is the registry: backend name -> its host coder, which also knows how to build the backend's
GPU coder where there is one (``huff4k``: Triton; ``deflate64k``: nvCOMP); :func:`device_coder` returns that GPU
coder for a device, built once per device. The container records which backend coded each stream. A stream
that does not shrink is stored with the ``raw`` backend.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import FormatError
from . import gaussian, huffman, huffman_gpu, nvcomp
from .buffers import Parts, Pinned


class EntropyCoder(Protocol):
    """A lossless coder of one entropy backend, on the host or on one device."""

    name: str

    def encode(self, payloads: list[Any]) -> list[bytes | Parts]:
        """One coded stream per payload (host coders: bytes; GPU coders: uint8 device tensors)."""
        ...

    def decode(self, streams: list[bytes | memoryview], raw_lens: list[int], pinned: Pinned | None = None) -> list[Any]:
        """Each stream decoded to exactly its ``raw_lens`` bytes (host coders: bytes; GPU coders: uint8 device
        tensors); a corrupt stream raises :class:`~kvtc.errors.FormatError`. ``pinned``: where the streams
        also lie in pinned host memory (a GPU coder may copy from there)."""
        ...


@dataclass(frozen=True)
class Backend:
    """A host coder: a backend's per-stream ``compress`` and ``decompress`` functions, and the factory of its
    GPU coder (None: CPU only)."""

    name: str
    compress: Callable[[bytes], bytes]
    decompress: Callable[[bytes, int], bytes]  # (data, raw_len) -> exactly raw_len bytes
    gpu: Callable[[torch.device], EntropyCoder | None] | None = None

    def encode(self, payloads: list[Any]) -> list[bytes | Parts]:
        return [self.compress(p) for p in payloads]

    def decode(self, streams: list[bytes | memoryview], raw_lens: list[int], pinned: Pinned | None = None) -> list[Any]:
        return [self.decompress(s, n) for s, n in zip(streams, raw_lens)]


def _raw_decompress(data: bytes, raw_len: int) -> bytes:
    if len(data) != raw_len:
        raise FormatError(f"raw stream holds {len(data)} bytes, header says {raw_len}")
    return bytes(data)


def _zlib_compress(data: bytes) -> bytes:
    return zlib.compress(data, 6)


def _zlib_decompress(data: bytes, raw_len: int) -> bytes:
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, raw_len)
        if d.unconsumed_tail or not d.eof or d.unused_data:
            raise FormatError("zlib stream is longer than its declared size or not terminated")
    except zlib.error as e:
        raise FormatError(f"corrupt zlib stream: {e}") from None
    if len(out) != raw_len:
        raise FormatError(f"zlib stream decoded to {len(out)} bytes, header says {raw_len}")
    return out


BACKENDS: dict[str, Backend] = {
    "raw": Backend("raw", bytes, _raw_decompress),
    "zlib": Backend("zlib", _zlib_compress, _zlib_decompress),
    # chunked raw DEFLATE: nvCOMP codes it on the GPU; its CPU twin (zlib) decodes it anywhere
    nvcomp.NAME: Backend(nvcomp.NAME, nvcomp.cpu_compress, nvcomp.cpu_decompress, nvcomp.device_coder),
    # per-stream canonical Huffman in 4 KiB blocks: Triton codes it on the GPU; its numpy twin decodes it anywhere
    huffman.NAME: Backend(huffman.NAME, huffman.cpu_compress, huffman.cpu_decompress, huffman_gpu.device_coder),
}

#: zstd of the differences between consecutive little-endian int64 words: a blob's token positions (a
#: sequence's positions count up by one, so the differences are a run of ones)
DELTA64 = "zstd-delta64"

try:
    import zstandard as _zstd

    _ZC = _zstd.ZstdCompressor(level=3)

    def _zstd_compress(data: bytes) -> bytes:
        return _ZC.compress(data)

    def _zstd_decompress(data: bytes, raw_len: int) -> bytes:
        try:
            params = _zstd.get_frame_parameters(data)
        except _zstd.ZstdError as e:
            raise FormatError(f"corrupt zstd stream: {e}") from None
        if params.content_size not in (raw_len, _zstd.CONTENTSIZE_UNKNOWN):
            raise FormatError(f"zstd frame declares {params.content_size} bytes, header says {raw_len}")
        try:
            out = _zstd.ZstdDecompressor().decompress(data, max_output_size=raw_len)
        except _zstd.ZstdError as e:
            raise FormatError(f"corrupt zstd stream: {e}") from None
        if len(out) != raw_len:
            raise FormatError(f"zstd stream decoded to {len(out)} bytes, header says {raw_len}")
        return out

    BACKENDS["zstd"] = Backend("zstd", _zstd_compress, _zstd_decompress)

    def _delta64(data: bytes, sign: int) -> bytes:
        """Little-endian int64 words of ``data`` as differences from the word before (``sign`` 1), or back
        (``sign`` -1); a tail of fewer than 8 bytes is left as it is."""
        import numpy as np

        n = len(data) // 8
        w = np.frombuffer(data, dtype="<i8", count=n)
        with np.errstate(over="ignore"):
            out = np.diff(w, prepend=np.int64(0)) if sign > 0 else np.cumsum(w, dtype=np.int64)
        return out.astype("<i8").tobytes() + bytes(data[8 * n :])

    BACKENDS[DELTA64] = Backend(
        DELTA64,
        lambda data: _zstd_compress(_delta64(data, 1)),
        lambda data, raw_len: _delta64(_zstd_decompress(data, raw_len), -1),
    )
except ImportError:  # pragma: no cover - zstandard is a hard dependency; kept for minimal installs
    pass

DEFAULT_BACKEND = "zstd" if "zstd" in BACKENDS else "zlib"


def get_backend(name: str) -> Backend:
    """The host coder of backend ``name``; a :class:`~kvtc.errors.FormatError` names the ones available."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise FormatError(
            f"entropy backend {name!r} is not available here (have {sorted(BACKENDS)}); "
            "install the package that provides it (zstd: `pip install zstandard`)"
        ) from None


_DEVICE_CODERS: dict[tuple[str, int], EntropyCoder] = {}


def device_coder(name: str, device: torch.device | str) -> EntropyCoder | None:
    """The GPU coder of backend ``name`` on ``device``, built once per device; None for a backend without one (or
    not registered), a device that is not CUDA, or a machine without CUDA or the coder's package."""
    device = torch.device(device)
    backend = BACKENDS.get(name)
    if backend is None or backend.gpu is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (name, idx)
    if key not in _DEVICE_CODERS:
        coder = backend.gpu(torch.device("cuda", idx))
        if coder is None:
            return None
        _DEVICE_CODERS[key] = coder
    return _DEVICE_CODERS[key]


@dataclass(frozen=True)
class Precoded:
    """A stream already coded before the container is written (by a GPU coder of ``backend``).

    ``raw`` returns the uncoded bytes; it is called only when coding did not shrink the stream.
    """

    backend: str
    coded: bytes | Parts
    raw_len: int
    raw: Callable[[], bytes]

    def __len__(self) -> int:
        return self.raw_len


class Int64s(bytes):
    """Little-endian int64 words (a blob's positions): also tried under :data:`DELTA64` beside a general-purpose
    host backend, the smaller kept."""


class Modeled(bytes):
    """Packed fixed-step symbol planes with the :class:`~kvtc.coding.gaussian.Hint` their ``gauss`` model is
    built from (bytes in every other respect)."""

    hint: gaussian.Hint

    def __new__(cls, data: bytes | memoryview, hint: gaussian.Hint) -> Modeled:
        out = super().__new__(cls, data)
        out.hint = hint
        return out


#: the general-purpose host backends beside which a :class:`Modeled` section is also tried under its Gaussians
#: (a GPU backend's sections stay its own, so that its device decodes the whole blob)
MODELED_WITH = frozenset({"zstd", "zlib"})


def _candidates(data: bytes, backend: str) -> list[tuple[str, Callable[[], bytes]]]:
    """The coders an encoder tries on a host section, in order (a tie keeps the earlier): the blob's backend, then
    where it is a general-purpose host backend (:data:`MODELED_WITH`) the one its section's kind is made for:
    positions as differences (:class:`Int64s`), fixed-step planes under their Gaussians (:class:`Modeled`)."""
    out: list[tuple[str, Callable[[], bytes]]] = []
    if backend != "raw":
        out.append((backend, lambda: get_backend(backend).encode([data])[0]))
    if backend in MODELED_WITH:
        if isinstance(data, Int64s) and DELTA64 in BACKENDS:
            out.append((DELTA64, lambda: get_backend(DELTA64).encode([data])[0]))
        if isinstance(data, Modeled) and gaussian.available():
            out.append((gaussian.NAME, lambda: gaussian.compress(data, data.hint)))
    return out


def encode_stream(data: bytes | Precoded, backend: str) -> tuple[str, bytes]:
    """Code ``data`` with ``backend`` (a :class:`Modeled` or :class:`Int64s` section beside a general-purpose host
    backend: also with the coder made for it, the smaller kept); falls back to ``raw`` when coding does not shrink
    it."""
    if isinstance(data, Precoded):
        if data.backend != "raw" and len(data.coded) < data.raw_len:
            return data.backend, data.coded
        return "raw", data.raw()
    best: tuple[str, bytes] = ("raw", bytes(data))
    for name, code in _candidates(data, backend) if data else ():
        coded = code()
        if len(coded) < len(best[1]):
            best = (name, coded)
    return best


def decode_stream(data: bytes, backend: str, raw_len: int, hint: gaussian.Hint | None = None) -> bytes:
    """Decode one host stream of ``backend`` to exactly ``raw_len`` bytes (``hint``: the model of a ``gauss``
    stream, from the blob's calibration and header)."""
    if backend == gaussian.NAME:
        return gaussian.decompress(data, raw_len, hint)
    return get_backend(backend).decode([data], [raw_len])[0]


__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "DELTA64",
    "MODELED_WITH",
    "Backend",
    "Int64s",
    "EntropyCoder",
    "Modeled",
    "Parts",
    "Pinned",
    "Precoded",
    "decode_stream",
    "device_coder",
    "encode_stream",
    "get_backend",
]
