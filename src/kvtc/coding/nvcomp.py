"""GPU entropy coding with nvCOMP, in a stream format that a CPU decodes too.

Backend ``deflate64k``: the stream is cut into chunks of :data:`CHUNK` bytes (the last one shorter), each
coded as a standard raw DEFLATE stream (RFC 1951), laid out as::

    u32 LE  chunk count c  (= ceil(raw_len / CHUNK); 0 for an empty stream)
    u32 LE  coded length of each chunk, c times
    ...     the c coded chunks, back to back

nvCOMP's batched Deflate codes the chunks in parallel on the GPU (``BitstreamKind.RAW``: no nvCOMP header,
so each chunk is a plain RFC 1951 stream); the CPU twin uses zlib with ``wbits=-15``. Either side decodes
what the other wrote, so a blob coded on the GPU opens on a CPU-only machine and the reverse. The CPU twin
is always registered in :data:`kvtc.coding.entropy.BACKENDS`; the GPU coder exists only where the
``nvidia-nvcomp-cu13`` (or ``-cu12``) package imports and CUDA is available (:func:`device_coder`, which the
entropy registry calls).

nvCOMP's ANS coder (faster, slightly smaller) has no CPU decoder, so it is not offered: a blob must stay
readable on any machine.
"""

from __future__ import annotations

import functools
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..errors import FormatError
from .buffers import Pinned, align

NAME = "deflate64k"
CHUNK = 1 << 16
_U32 = struct.Struct("<I")
#: zlib level of the CPU twin (the GPU coder has its own fixed algorithm; both emit valid DEFLATE)
CPU_LEVEL = 6
#: nvCOMP Deflate algorithm (0: highest throughput, entropy-only Huffman coding)
ALGORITHM_TYPE = 0
#: room for one coded chunk in the GPU output buffer (DEFLATE's worst case for 64 KiB is far below this)
_SLOT = 2 * CHUNK


def _chunk_table(data: memoryview | bytes, raw_len: int) -> tuple[list[int], int]:
    count = -(-raw_len // CHUNK)
    if len(data) < 4:
        raise FormatError(f"{NAME} stream shorter than its chunk count")
    (c,) = _U32.unpack_from(data, 0)
    if c != count:
        raise FormatError(f"{NAME} stream has {c} chunks, {count} expected for {raw_len} bytes")
    head = 4 + 4 * c
    if len(data) < head:
        raise FormatError(f"{NAME} stream ends inside its chunk table")
    sizes = list(np.frombuffer(bytes(data[4:head]), dtype="<u4").astype(np.int64)) if c else []
    if head + sum(sizes) != len(data):
        raise FormatError(f"{NAME} chunk sizes do not add up to the stream length")
    return sizes, head


def _frame(coded: list[bytes]) -> bytes:
    table = np.asarray([len(c) for c in coded], dtype="<u4").tobytes()
    return b"".join([_U32.pack(len(coded)), table, *coded])


def cpu_compress(data: bytes) -> bytes:
    mv = memoryview(data)
    out = []
    for off in range(0, len(mv), CHUNK):
        z = zlib.compressobj(CPU_LEVEL, zlib.DEFLATED, -15)
        out.append(z.compress(mv[off : off + CHUNK]) + z.flush())
    return _frame(out)


def cpu_decompress(data: bytes, raw_len: int) -> bytes:
    mv = memoryview(data)
    sizes, off = _chunk_table(mv, raw_len)
    out = bytearray(raw_len)
    pos = 0
    for i, n in enumerate(sizes):
        want = min(CHUNK, raw_len - i * CHUNK)
        d = zlib.decompressobj(-15)
        try:
            got = d.decompress(mv[off : off + n], want)
            if d.unconsumed_tail or not d.eof or d.unused_data:
                raise FormatError(f"{NAME} chunk {i} is longer than {want} bytes or not terminated")
        except zlib.error as e:
            raise FormatError(f"corrupt {NAME} chunk {i}: {e}") from None
        if len(got) != want:
            raise FormatError(f"{NAME} chunk {i} decoded to {len(got)} bytes, {want} expected")
        out[pos : pos + want] = got
        pos += want
        off += n
    return bytes(out)


class _CudaBuffer:
    """A raw device range with ``__cuda_array_interface__`` (what nvCOMP's array import reads)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class DeviceCoder:
    """nvCOMP batched raw Deflate over 64 KiB chunks of device tensors (one batch for all streams)."""

    def __init__(self, nvcomp: Any, device: torch.device):
        self.nv = nvcomp
        self.device = device
        kw = dict(algorithm="Deflate", bitstream_kind=nvcomp.BitstreamKind.RAW, uncomp_chunk_size=CHUNK)
        try:  # entropy-only Deflate: the planes are already bit-packed, so Huffman coding is where the gain is
            self.codec = nvcomp.Codec(**kw, algorithm_type=ALGORITHM_TYPE)
        except Exception:  # noqa: BLE001 - a package without the option: its default Deflate
            self.codec = nvcomp.Codec(**kw)
        self.pool = ThreadPoolExecutor(8)
        #: seconds of the last call's steps (for benchmarks)
        self.last: dict[str, float] = {}

    def _batch(self, t: torch.Tensor, offsets: list[int], sizes: list[int]) -> Any:
        base = t.data_ptr()
        return self.nv.as_arrays([_CudaBuffer(base + o, s) for o, s in zip(offsets, sizes)])

    def compress(self, tensors: list[torch.Tensor]) -> list[bytes]:
        """Code each uint8 device tensor; returns one ``deflate64k`` stream per tensor."""
        flat = [t.contiguous().view(torch.uint8).reshape(-1) for t in tensors]
        starts, pos = [], 0
        for t in flat:  # nvCOMP wants aligned chunk addresses: every stream starts on a 16-byte boundary
            starts.append(pos)
            pos += align(t.numel())
        src = torch.empty(max(pos, 1), dtype=torch.uint8, device=self.device)
        for t, st in zip(flat, starts):
            src[st : st + t.numel()].copy_(t)
        spans, offs, sizes = [], [], []
        for t, st in zip(flat, starts):
            n = t.numel()
            first = len(sizes)
            for o in range(0, n, CHUNK):
                offs.append(st + o)
                sizes.append(min(CHUNK, n - o))
            spans.append((first, len(sizes)))
        if not sizes:
            return [_frame([]) for _ in tensors]
        t0 = time.perf_counter()
        dst = torch.empty(len(sizes) * _SLOT, dtype=torch.uint8, device=self.device)
        try:
            enc = self.codec.encode(
                self._batch(src, offs, sizes),
                out=self._batch(dst, [i * _SLOT for i in range(len(sizes))], [_SLOT] * len(sizes)),
            )
            got = [int(x) for x in enc.buffer_sizes]  # waits for the coder
        except (TypeError, ValueError, RuntimeError):  # a package without out= batches: one copy per chunk
            enc = self.codec.encode(self._batch(src, offs, sizes))
            host = enc.cpu()
            coded = [bytes(np.asarray(host[i])) for i in range(len(sizes))]
            self.last = {"gpu_code_s": time.perf_counter() - t0}
            return [_frame(coded[a:b]) for a, b in spans]
        t1 = time.perf_counter()
        host = torch.empty(dst.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(dst)
        h = host.numpy()
        t2 = time.perf_counter()
        out = []
        for a, b in spans:
            table = np.asarray(got[a:b], dtype="<u4").tobytes()
            out.append(
                b"".join([_U32.pack(b - a), table, *(h[i * _SLOT : i * _SLOT + got[i]].data for i in range(a, b))])
            )
        self.last = {"gpu_code_s": t1 - t0, "d2h_s": t2 - t1, "frame_s": time.perf_counter() - t2}
        return out

    def decompress(self, streams: list[bytes | memoryview], raw_lens: list[int]) -> list[torch.Tensor]:
        """Decode ``deflate64k`` streams into uint8 device tensors of exactly ``raw_lens`` bytes."""
        tables = [_chunk_table(memoryview(s), n) for s, n in zip(streams, raw_lens)]
        c_offs, c_sizes, o_offs, o_sizes, o_starts = [], [], [], [], []
        cpos = opos = 0
        for (sizes, _), n in zip(tables, raw_lens):
            o_starts.append(opos)
            for i, sz in enumerate(sizes):
                c_offs.append(cpos)
                c_sizes.append(int(sz))
                cpos += align(int(sz))  # nvCOMP wants aligned chunk addresses
                o_offs.append(opos + i * CHUNK)
                o_sizes.append(min(CHUNK, n - i * CHUNK))
            opos += align(n)
        t0 = time.perf_counter()
        staging = torch.empty(max(cpos, 1), dtype=torch.uint8, pin_memory=True)
        buf = staging.numpy()
        k = 0
        for s, (sizes, head) in zip(streams, tables):
            src = np.frombuffer(s, dtype=np.uint8)
            off = head
            for sz in sizes:
                sz = int(sz)
                buf[c_offs[k] : c_offs[k] + sz] = src[off : off + sz]
                off += sz
                k += 1
        t1 = time.perf_counter()
        coded = staging.to(self.device, non_blocking=True)
        out = torch.empty(max(opos, 1), dtype=torch.uint8, device=self.device)
        torch.cuda.current_stream(self.device).synchronize()
        t2 = time.perf_counter()
        if c_sizes:
            res = self.codec.decode(self._batch(coded, c_offs, c_sizes), out=self._batch(out, o_offs, o_sizes))
            got = list(res.buffer_sizes) if hasattr(res, "buffer_sizes") else o_sizes
            if [int(g) for g in got] != o_sizes:
                raise FormatError(f"{NAME}: a chunk decoded to the wrong size on the GPU")
        self.last = {"stage_s": t1 - t0, "h2d_s": t2 - t1, "gpu_decode_s": time.perf_counter() - t2}
        return [out[st : st + n] for st, n in zip(o_starts, raw_lens)]

    def encode(self, tensors: list[torch.Tensor]) -> list[bytes]:
        """:meth:`compress` (the entropy coder protocol's name)."""
        return self.compress(tensors)

    def decode(self, streams: list[bytes | memoryview], raw_lens: list[int], pinned: Pinned | None = None) -> list[Any]:
        """:meth:`decompress` (the entropy coder protocol's name); the streams are staged from host memory
        whether or not they lie in ``pinned``."""
        return self.decompress(streams, raw_lens)


@functools.cache
def _nvcomp() -> Any:
    try:
        from nvidia import nvcomp  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - absent or broken package: no GPU coder
        return None
    return nvcomp


def device_coder(device: torch.device) -> DeviceCoder | None:
    """A ``deflate64k`` GPU coder on ``device`` (a CUDA device), or None where nvCOMP does not import."""
    nv = _nvcomp()
    return None if nv is None else DeviceCoder(nv, device)


__all__ = ["NAME", "CHUNK", "cpu_compress", "cpu_decompress", "device_coder", "DeviceCoder"]
