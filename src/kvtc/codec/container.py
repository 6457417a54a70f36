"""Container format v2: the bytes of one compressed KV slice (specified in docs/FORMAT.md).

```
offset  size  field
0       4     magic b"KVTC"
4       2     format version, u16 little-endian (1, 2, 3 or 4)
6       2     flags, u16 (0; any other value is refused)
8       4     header length H, u32 LE (16 <= H <= MAX_HEADER_BYTES)
12      4     CRC-32 of the header bytes, u32 LE
16      H     header: UTF-8 JSON object (see Header)
16+H    ...   sections, back to back, in the header's order; nothing after the last one
```

The parser checks magic, version, flags and the header CRC before it parses JSON, validates every header
field's type and range, bounds every declared size by the token counts and the layout before anything is
allocated, and checks each section's CRC-32 before its bytes are decoded. It never executes anything.

Version 2 adds per-layer held-token counts (``layout.max_tokens``: sliding-window layers hold only their newest
tokens, and only those are stored). A slice whose layers all hold every token is written as version 1, byte for
byte what earlier releases wrote, so they keep reading it; a reader of version 1 only refuses version 2.

Version 3 adds token-adaptive rates (``tiers``: each PCA group's middle tokens coded by two plans, a bit mask per
group saying which token took which, :mod:`kvtc.codec.tiers`), with or without per-layer held-token counts. Only
blobs that use them are written as version 3; a reader of versions 1-2 refuses them by their version.

Version 4 adds the rate ladder (``rungs``: each token of each kind and PCA group coded by one of several plans,
``rung_counts`` the tokens each plan codes, a byte per token in section ``rungs.{kind}.{g}`` saying which). kvtc
writes version 4 for every token-adaptive blob and still reads version 3.

Version 5 adds the token ids (``predicted``: the middle tokens are coded less the calibration's token-map prediction,
:mod:`kvtc.codec.prediction`; section ``tokens``, int32 ``[B, T]``, right after ``positions``), with any of the
above. Only such blobs are written as version 5.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..coding.buffers import Parts
from ..coding.entropy import EntropyCoder, decode_stream, encode_stream
from ..errors import FormatError, OutputBufferError
from ..fileio import _open_regular
from . import budget
from .crc import PIECE, crc32_combine, crc32_many, crc32_submit, default_pool
from .header import PAD_SECTION, Header, Section, parse_header  # Header, Section: part of the container's interface

MAGIC = b"KVTC"
VERSION = 5
#: versions this kvtc reads (1: every layer holds every token; 2: per-layer held-token counts; 3: two tiers;
#: 4: the rate ladder; 5: token ids, the middle tokens coded less their prediction)
VERSIONS = (1, 2, 3, 4, 5)
PREFIX = struct.Struct("<4sHHII")
MAX_HEADER_BYTES = 1 << 20


def write(
    header: Header,
    payloads: list[tuple[str, Any]],
    backend: str,
    timings: dict[str, float] | None = None,
    out: Any = None,
) -> Any:
    """Entropy-code each named payload with ``backend`` (raw fallback) and assemble the container.
    ``timings``: receives seconds of its steps (``container.code``, ``container.crc``, ``container.join``).
    ``out``: a writable buffer (see :func:`write_into`) that receives the container instead of a new ``bytes``;
    the blob is then returned as a view of its first bytes."""
    t0 = time.perf_counter()
    coded_all = [encode_stream(data, backend) for _, data in payloads]
    t1 = time.perf_counter()
    # a section is one buffer or several (Parts); every piece is checksummed on host threads, then combined
    pieces = [list(c.buffers) if isinstance(c, Parts) else [c] for _, c in coded_all]
    flat = crc32_many([b for ps in pieces for b in ps])
    crcs, i = [], 0
    for ps in pieces:
        crc = None
        for b in ps:
            crc = flat[i] if crc is None else crc32_combine(crc, flat[i], len(b))
            i += 1
        crcs.append(crc or 0)
    bodies = [b for ps in pieces for b in ps]
    t2 = time.perf_counter()
    sections = [
        Section(name, used, len(data), len(coded), crc)
        for (name, data), (used, coded), crc in zip(payloads, coded_all, crcs)
    ]
    pad = padding(sections)
    if pad is not None:
        sections.append(pad[0])
        bodies.append(pad[1])
    header.sections = sections
    parts = [prefix_and_header(header), *bodies]
    blob = b"".join(parts) if out is None else write_into(out, parts)
    if timings is not None:
        timings.update(
            {"container.code": t1 - t0, "container.crc": t2 - t1, "container.join": time.perf_counter() - t2}
        )
    return blob


def header_bytes(header: Header) -> bytes:
    """The canonical JSON of ``header``: the only spelling of it a reader accepts."""
    return json.dumps(header.to_json(), separators=(",", ":"), sort_keys=True).encode()


def padding(sections: list[Section]) -> tuple[Section, bytes] | None:
    """The ``pad`` section a blob of ``sections`` needs so that its sections' raw bytes are at most
    :data:`~kvtc.codec.budget.MAX_CODER_GAIN` times their coded bytes (what a decoder allows; docs/FORMAT.md,
    "Decoding allowance"), or None when it needs none. Only streams that shrink far more than real KV does (an
    all-zero cache) need one."""
    raw, coded = sum(x.raw for x in sections), sum(x.coded for x in sections)
    if not budget.needs_padding(raw, coded):
        return None
    n = budget.pad_bytes(raw, coded)
    zeros = bytes(n)
    return Section(PAD_SECTION, "raw", n, n, zlib.crc32(zeros)), zeros


def prefix_and_header(header: Header) -> bytes:
    """The container's first bytes: the prefix and the JSON header of ``header`` (its sections filled in)."""
    hdr = header_bytes(header)
    if len(hdr) > MAX_HEADER_BYTES:
        raise FormatError("container header would exceed 1 MiB; split the slice into smaller ones")
    return PREFIX.pack(MAGIC, header.version, 0, len(hdr), zlib.crc32(hdr)) + hdr


def output_buffer(out: Any, total: int) -> np.ndarray:
    """``out`` (see :func:`write_into`) as a writable uint8 numpy array, checked to hold ``total`` bytes: raises
    :class:`~kvtc.errors.OutputBufferError` (nothing written) for a buffer of the wrong kind, read-only or small."""
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu" or out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
            raise OutputBufferError(
                "an output tensor must be a contiguous 1-D uint8 CPU tensor (e.g. pinned host memory)"
            )
        dst = out.numpy().view(np.uint8)
    else:
        try:
            dst = np.frombuffer(out, dtype=np.uint8)
        except (TypeError, ValueError, BufferError):
            raise OutputBufferError(
                f"cannot write a blob into a {type(out).__name__}; pass a bytearray, a "
                "writable memoryview or numpy array, or a uint8 CPU tensor"
            ) from None
        if not dst.flags.writeable:
            raise OutputBufferError(f"the output buffer ({type(out).__name__}) is read-only")
    if total > dst.size:
        raise OutputBufferError(
            f"the blob needs {total} bytes and the output buffer holds {dst.size}; pass a larger buffer", needed=total
        )
    return dst


def blob_view(out: Any, total: int) -> Any:
    """The first ``total`` bytes of ``out`` as :func:`write_into` returns them (a tensor slice or a memoryview)."""
    return out[:total] if isinstance(out, torch.Tensor) else memoryview(out).cast("B")[:total]


def copy_pieces(jobs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Run ``np.copyto(dst, src)`` for each pair, large ones cut in pieces on host threads (numpy drops the GIL)."""
    cut = []
    for dst, src in jobs:
        for a in range(0, len(src), PIECE):
            cut.append((dst[a : a + PIECE], src[a : a + PIECE]))
    if len(cut) > 1:
        list(default_pool().map(lambda j: np.copyto(j[0], j[1]), cut))
    elif cut:
        np.copyto(cut[0][0], cut[0][1])


def write_into(out: Any, parts: list[Any]) -> Any:
    """Copy ``parts`` back to back into ``out`` (a 1-D uint8 CPU tensor, e.g. pinned host memory, or any writable
    bytes-like object: bytearray, memoryview, numpy array, mmap) and return the used prefix as a view of ``out``
    (a tensor slice for a tensor, else a memoryview). Large copies run on host threads. A buffer that is too
    small or not writable raises :class:`~kvtc.errors.OutputBufferError` before anything is written."""
    views = [memoryview(p).cast("B") if not isinstance(p, bytes) else memoryview(p) for p in parts]
    total = sum(len(v) for v in views)
    dst = output_buffer(out, total)
    jobs, off = [], 0
    for v in views:
        src = np.frombuffer(v, dtype=np.uint8)
        jobs.append((dst[off : off + len(src)], src))
        off += len(src)
    copy_pieces(jobs)
    return blob_view(out, total)


def read_header(blob: bytes | bytearray | memoryview, partial: bool = False) -> tuple[Header, int]:
    """Parse and validate the prefix and header; returns the header and the body offset. ``partial``: ``blob``
    holds the prefix and header only (the caller checks the sections' total size against what follows)."""
    blob = memoryview(blob)
    if len(blob) < PREFIX.size:
        raise FormatError(f"blob is {len(blob)} bytes, shorter than the {PREFIX.size}-byte kvtc prefix (truncated?)")
    magic, version, flags, hlen, hcrc = PREFIX.unpack_from(blob, 0)
    if magic != MAGIC:
        raise FormatError("not a kvtc blob (bad magic); was it written by kvtc?")
    if version not in VERSIONS:
        raise FormatError(
            f"kvtc container version {version} is not supported (this kvtc reads {', '.join(map(str, VERSIONS))}); "
            "upgrade kvtc"
        )
    if flags != 0:
        raise FormatError(f"unknown container flags {flags:#x}; the blob is corrupt or from a newer kvtc")
    if not 16 <= hlen <= MAX_HEADER_BYTES:
        raise FormatError(f"container header length {hlen} out of range; the blob is corrupt")
    if PREFIX.size + hlen > len(blob):
        raise FormatError("blob ends inside its header (truncated)")
    raw = bytes(blob[PREFIX.size : PREFIX.size + hlen])
    if zlib.crc32(raw) != hcrc:
        raise FormatError("container header checksum mismatch; the blob is corrupt")
    try:
        d = json.loads(raw.decode("utf-8"))  # bytes would also be read as UTF-16/32 or with a BOM
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise FormatError("container header is not valid JSON; the blob is corrupt") from None
    header = parse_header(d)
    if header_bytes(header) != raw:  # one spelling per header: no spaces, duplicate keys or other number forms
        raise FormatError(
            "container header is not in canonical form (sorted keys, no spaces, numbers and strings as kvtc writes "
            "them); the blob is corrupt or was not written by kvtc"
        )
    if header.predicted != (version == 5):
        raise FormatError(
            f"container version {version} {'with' if header.predicted else 'without'} token ids (version 5 has them, "
            "no other version does); the blob is corrupt"
        )
    if version != 5:  # version 5 carries any of the layouts, tiers or ladders of versions 1-4
        _check_version(header, version)
    body = PREFIX.size + hlen
    total = sum(s.coded for s in header.sections)
    if not partial and body + total != len(blob):
        what = "truncated" if body + total > len(blob) else "has trailing bytes"
        raise FormatError(f"blob {what}: sections need {total} bytes after the header, found {len(blob) - body}")
    return header, body


def _check_version(header: Header, version: int) -> None:
    """Versions 1-4: the version says which of tiers, a rate ladder and per-layer held-token counts the blob has."""
    if header.tiers and version != 3:
        raise FormatError(f"container version {version} with token-adaptive tiers (only version 3 has them); corrupt")
    if not header.tiers and version == 3:
        raise FormatError("container version 3 without token-adaptive tiers; the blob is corrupt")
    if bool(header.rungs) != (version == 4):
        raise FormatError(
            f"container version {version} {'with' if header.rungs else 'without'} a rate ladder "
            "(version 4 has one, no other version does); the blob is corrupt"
        )
    if not header.adaptive and header.version != version:
        raise FormatError(
            f"container version {version} with a layout that {'lacks' if version == 2 else 'has'} per-layer held-token "
            "counts (version 2 carries them, version 1 never does); the blob is corrupt"
        )


def section_chunks(
    blob: bytes | bytearray | memoryview, header: Header, body: int, expected_raw: dict[str, int] | None = None
) -> tuple[list[memoryview], list[int]]:
    """Each section's coded bytes (a view of ``blob``) and byte offset, after checking the sections' names and raw
    sizes against ``expected_raw`` (what the blob's settings require)."""
    blob = memoryview(blob).cast("B") if not isinstance(blob, bytes) else memoryview(blob)
    if expected_raw is not None and header.sections and header.sections[-1].name == PAD_SECTION:
        expected_raw = {**expected_raw, PAD_SECTION: header.sections[-1].raw}  # its size: budget.check_allowance's
    if expected_raw is not None:
        names = [s.name for s in header.sections]
        if names != list(expected_raw):
            raise FormatError(
                f"blob sections {names[:6]} do not match what its settings require {list(expected_raw)[:6]}"
            )
    chunks, offsets, off = [], [], body
    for s in header.sections:
        if expected_raw is not None and expected_raw[s.name] != s.raw:
            raise FormatError(f"section {s.name}: {s.raw} bytes declared, {expected_raw[s.name]} expected")
        chunks.append(blob[off : off + s.coded])
        offsets.append(off)
        off += s.coded
    return chunks, offsets


def read_sections(
    blob: bytes | bytearray | memoryview,
    header: Header,
    body: int,
    expected_raw: dict[str, int] | None = None,
    coder: EntropyCoder | None = None,
    backend: str | None = None,
    pinned: Any = None,
    deferred: list[Any] | None = None,
    hints: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Check CRCs and decode every section. ``expected_raw``: exact raw sizes the caller derived; ``hints``: the
    model of each section a ``gauss`` stream may code (:class:`kvtc.coding.gaussian.Hint`, by name; a ``gauss``
    stream without one is refused).

    With ``coder`` (the GPU coder of entropy backend ``backend``), that backend's sections are decoded on its
    device in one batch into uint8 device tensors (``pinned``: the blob itself as a pinned uint8 host tensor, so
    a coder may copy from it to the device without staging); the CRC-32s are then checked on host threads while
    the device decodes, and a mismatch raises before anything is returned. Other sections decode on the CPU.
    ``deferred``: a list that receives the checksum check of the device-decoded sections instead of running it
    here, so that it overlaps the caller's device work; the caller must run it before handing anything out.
    """
    chunks, offsets = section_chunks(blob, header, body, expected_raw)
    pending = crc32_submit(chunks)
    out: dict[str, Any] = {}
    on_device = [i for i, s in enumerate(header.sections) if coder is not None and s.backend == backend]
    device_error: FormatError | None = None
    if on_device:
        raws = [header.sections[i].raw for i in on_device]
        try:
            dec = coder.decode(
                [chunks[i] for i in on_device],
                raws,
                None if pinned is None else (pinned, [offsets[i] for i in on_device]),
            )
            out.update({header.sections[i].name: t for i, t in zip(on_device, dec)})
        except FormatError as e:  # reported after the checksums: a damaged blob says so first
            device_error = e

    def check() -> None:
        for s, crc in zip(header.sections, pending.result()):
            if crc != s.crc32:
                raise FormatError(f"section {s.name}: checksum mismatch; the blob is corrupt")

    if device_error is not None or deferred is None:
        check()
    if device_error is not None:
        raise device_error
    if deferred is not None:
        deferred.append(check)
    for i, s in enumerate(header.sections):
        if s.name not in out:
            out[s.name] = decode_stream(bytes(chunks[i]), s.backend, s.raw, (hints or {}).get(s.name))
    return {s.name: out[s.name] for s in header.sections}


def read_blob(path: str | os.PathLike[str]) -> bytes:
    """A ``.kvtc`` file's bytes: opened only if it is a regular file; its prefix and header are read and
    validated first, and the rest only if the header accounts for exactly the file's size."""
    path = Path(path)
    with _open_regular(path, "a .kvtc file", FormatError) as (f, size):
        head = f.read(PREFIX.size)
        if len(head) == PREFIX.size:
            hlen = PREFIX.unpack(head)[3]
            if hlen <= MAX_HEADER_BYTES:
                head += f.read(hlen)
        try:
            header, body = read_header(head, partial=True)
        except FormatError as e:
            raise FormatError(f"{path}: {e}") from None
        need = body + sum(s.coded for s in header.sections)
        if need != size:
            raise FormatError(
                f"{path}: the file holds {size} bytes, its header accounts for {need} (truncated or extended)"
            )
        f.seek(0)  # one read of the whole file: no second copy of a body that may be gigabytes
        data = f.read(size + 1)
        if len(data) != size:
            raise FormatError(f"{path} changed size while being read; read it again")
        return data
