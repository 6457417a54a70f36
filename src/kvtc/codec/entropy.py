"""Lossless entropy backends behind one interface.

A backend turns bytes into bytes and back, and must refuse to produce more output than the caller
declares (``raw_len`` comes from the validated container header), so a malicious stream cannot make a
decoder allocate without bound. A stream that does not shrink is stored with the ``raw`` backend.

Backends are looked up by name in :data:`BACKENDS`; the GPU (nvCOMP) backend registers itself here when
its package is importable, under its own name, so the container records which one coded each stream and
any machine with that backend can decode it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

from ..errors import FormatError


@dataclass(frozen=True)
class Backend:
    name: str
    compress: Callable[[bytes], bytes]
    decompress: Callable[[bytes, int], bytes]  # (data, raw_len) -> exactly raw_len bytes


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
}

# chunked raw DEFLATE: nvCOMP codes it on the GPU; its CPU twin (zlib) is always here, so any machine decodes it
from . import nvcomp as _nvcomp  # noqa: E402 - needs Backend; imports nothing GPU-side until asked

BACKENDS[_nvcomp.NAME] = Backend(_nvcomp.NAME, _nvcomp.cpu_compress, _nvcomp.cpu_decompress)

# per-stream canonical Huffman in 4 KiB blocks: Triton codes it on the GPU; its numpy twin decodes it anywhere
from . import huffman as _huffman  # noqa: E402 - imports nothing GPU-side until asked

BACKENDS[_huffman.NAME] = Backend(_huffman.NAME, _huffman.cpu_compress, _huffman.cpu_decompress)

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
except ImportError:  # pragma: no cover - zstandard is a hard dependency; kept for minimal installs
    pass

DEFAULT_BACKEND = "zstd" if "zstd" in BACKENDS else "zlib"


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise FormatError(
            f"entropy backend {name!r} is not available here (have {sorted(BACKENDS)}); "
            "install the package that provides it (zstd: `pip install zstandard`)"
        ) from None


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


def encode_stream(data: bytes | Precoded, backend: str) -> tuple[str, bytes]:
    """Code ``data`` with ``backend``; falls back to ``raw`` when coding does not shrink it."""
    if isinstance(data, Precoded):
        if data.backend != "raw" and len(data.coded) < data.raw_len:
            return data.backend, data.coded
        return "raw", data.raw()
    if backend != "raw" and data:
        coded = get_backend(backend).compress(data)
        if len(coded) < len(data):
            return backend, coded
    return "raw", bytes(data)


def decode_stream(data: bytes, backend: str, raw_len: int) -> bytes:
    return get_backend(backend).decompress(data, raw_len)
