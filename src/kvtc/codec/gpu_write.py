"""Container assembly for streams coded on the GPU: the coded words go from the device straight to their place
in the blob.

The general writer (:func:`kvtc.codec.container.write`) needs every stream on the host before it can checksum
them and so size the header, and only then copies them behind it: a device-to-host copy into a staging buffer
and a second full copy into the blob. Here the CRC-32 of each coded stream is computed on the device
(:mod:`kvtc.kernels.triton_crc`) while it is still there, so the header is known first and each stream's words
are copied once, from the device into the output at their final offset (the caller's pinned buffer for
``encode(kv, out=...)``). A ``bytes`` result is written the same way into a reused pinned buffer and then copied
once, on host threads, into a new ``bytes`` object (:func:`kvtc.coding.buffers.new_bytes`). The bytes written are
those of :func:`~kvtc.codec.container.write` for the same streams (``tests/test_gpu.py`` compares them).
"""

from __future__ import annotations

import threading
import time
import zlib
from typing import Any

import numpy as np
import torch

from ..coding.buffers import PinnedScratch, host_bytes, new_bytes
from ..coding.entropy import encode_stream
from . import container
from .crc import crc32_combine, crc32_many

_LOCAL = threading.local()


def _scratch() -> PinnedScratch:
    if not hasattr(_LOCAL, "scratch"):
        _LOCAL.scratch = PinnedScratch()
    return _LOCAL.scratch


def supported(coder: Any) -> bool:
    """Whether ``coder`` (a GPU entropy coder) codes on the device and leaves the words there (``huff4k``)."""
    return hasattr(coder, "encode_device") and hasattr(coder, "heads")


def write(
    header: container.Header,
    payloads: list[tuple[str, Any]],
    backend: str,
    coder: Any,
    timings: dict[str, float] | None = None,
    out: Any = None,
) -> Any:
    """The container of ``payloads`` (device uint8 tensors, coded here with ``coder``, or host bytes, coded on
    the CPU with ``backend``), written into ``out`` (see :func:`kvtc.codec.container.write_into`; the blob is
    returned as a view of it) or returned as ``bytes``."""
    from ..kernels.triton_crc import CHUNK, region_crcs

    t0 = time.perf_counter()
    dev_idx = [i for i, (_, d) in enumerate(payloads) if isinstance(d, torch.Tensor)]
    device = payloads[dev_idx[0]][1].device if dev_idx else torch.device("cpu")
    enc = coder.encode_device([payloads[i][1] for i in dev_idx])
    heads = coder.heads(enc)
    t1 = time.perf_counter()
    # per section: (backend used, coded length, head bytes and (first word, words) on the device | host bytes)
    plan: list[tuple[str, int, Any]] = [("", 0, None)] * len(payloads)
    regions, coded_idx = [], []
    for j, i in enumerate(dev_idx):
        d = payloads[i][1]
        a, b = enc["spans"][j]
        nw = int(enc["words"][a:b].sum())
        size = len(heads[j]) + 4 * nw
        if backend != "raw" and size < d.numel():
            plan[i] = (backend, size, (heads[j], enc["wstart"][j], nw))
            regions.append((enc["wstart"][j], 4 * nw))
            coded_idx.append(i)
        else:  # coding did not shrink it: stored raw, as the general writer does
            raw = host_bytes(d)
            plan[i] = ("raw", len(raw), raw)
    for i, (_, d) in enumerate(payloads):
        if not isinstance(d, torch.Tensor):
            used, coded = encode_stream(d, backend)
            plan[i] = (used, len(coded), coded)
    t2 = time.perf_counter()
    full, counts = region_crcs(enc["out"], regions)
    tails = [
        enc["out"][w + CHUNK // 4 * c : w + n // 4] for (w, n), c in zip(regions, counts)
    ]  # the last partial chunk of each stream
    tail_bytes = torch.cat(tails).cpu().numpy().tobytes() if tails else b""
    full_h = full.cpu().tolist()
    host_idx = [i for i in range(len(payloads)) if i not in set(coded_idx)]
    host_crc = dict(zip(host_idx, crc32_many([memoryview(plan[i][2]) for i in host_idx])))
    crcs: dict[int, int] = {}
    pos = 0
    for k, i in enumerate(coded_idx):
        head, _, nw = plan[i][2]
        n_tail = 4 * nw - CHUNK * counts[k]
        tail_crc = zlib.crc32(tail_bytes[pos : pos + n_tail])
        pos += n_tail
        words_crc = crc32_combine(full_h[k], tail_crc, n_tail) if counts[k] else tail_crc
        crcs[i] = crc32_combine(zlib.crc32(head), words_crc, 4 * nw)
    crcs.update(host_crc)
    t3 = time.perf_counter()
    header.sections = [
        container.Section(
            name, plan[i][0], int(d.numel()) if isinstance(d, torch.Tensor) else len(d), plan[i][1], crcs[i]
        )
        for i, (name, d) in enumerate(payloads)
    ]
    pad = container.padding(header.sections)
    if pad is not None:  # streams that shrank far more than real KV does: see container.padding
        header.sections.append(pad[0])
        plan.append(("raw", pad[0].coded, pad[1]))
    pre = container.prefix_and_header(header)
    total = len(pre) + sum(p[1] for p in plan)
    if out is not None:
        dst = container.output_buffer(out, total)  # refused before anything is written
        dst_t = out if isinstance(out, torch.Tensor) else torch.from_numpy(dst)
    else:
        dst_t = _scratch().get(total)
        dst = dst_t.numpy()
    dst[: len(pre)] = np.frombuffer(pre, dtype=np.uint8)
    words = enc["out"].view(torch.uint8)
    jobs, off = [], len(pre)
    for i in range(len(plan)):
        used, size, data = plan[i]
        if isinstance(data, tuple):
            head, ws, nw = data
            dst[off : off + len(head)] = np.frombuffer(head, dtype=np.uint8)
            a = off + len(head)
            dst_t[a : a + 4 * nw].copy_(words[4 * ws : 4 * (ws + nw)], non_blocking=True)
        else:
            jobs.append((dst[off : off + size], np.frombuffer(data, dtype=np.uint8)))
        off += size
    container.copy_pieces(jobs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t4 = time.perf_counter()
    if out is not None:
        blob = container.blob_view(out, total)
    else:
        made = new_bytes(total)
        if made is None:
            blob = dst[:total].tobytes()
        else:
            blob, view = made
            container.copy_pieces([(view, dst[:total])])
    if timings is not None:
        timings.update(
            {
                "gpu_entropy": t1 - t0,
                "container.code": t2 - t1,
                "container.crc": t3 - t2,
                "container.d2h": t4 - t3,
                "container.join": time.perf_counter() - t4,
            }
        )
        timings.update({f"coder.{k}": v for k, v in getattr(coder, "last", {}).items()})
    return blob


__all__ = ["supported", "write"]
