"""The GPU restore path of :class:`~kvtc.codec.codec.Codec`: a blob in (pinned) host memory -> a KV slice on the
GPU, its stages overlapped.

:meth:`Codec.decode` and :meth:`Codec.decode_layers` take this path for a ``kvtc`` blob coded with ``huff4k``
(sections stored raw are fine too) and one PCA group, decoded onto the codec's CUDA device; anything else takes the
general path. The blob's sections are read in two phases, keys (with the positions and protected tokens) and
values. Each phase's coded words go to the device on a copy stream and its entropy decode is queued behind them;
the host then queues the keys' unpack+dequantize and reconstruction and only then parses the values' streams, so
the values' copy and parsing run while the keys are being reconstructed. Nothing waits for the device in between:
the entropy decoder raises a device flag on a corrupt block, and the CRC-32 of every section runs on host threads
meanwhile (started once the first phase is queued, so that they do not compete with its parsing); both are checked before anything is returned (:meth:`Codec.decode`) or yielded
(:meth:`Codec.decode_layers`, which checks them once every coefficient is decoded and then reconstructs one layer
at a time, each layer's product queued and handed over without waiting for the device, so an engine can queue its
own work on layer 0 while later layers are still being computed).

The fp8 reconstruction takes its operand straight from the unpack+dequantize kernel (coefficients divided by their
components' standard deviations, written as E4M3; :class:`~kvtc.codec.transform.PCATransform`); a sequence's
middle tokens are written by the product straight into the output when it has enough of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from ..calibration.artifact import KINDS
from ..errors import FormatError
from ..layout import DTYPES, KVSlice
from . import container
from .buffers import section_tensor
from .clock import stage_clock
from .crc import crc32_submit
from .entropy import decode_stream, device_coder
from .huffman import NAME
from .quantizer import PlanLayout

#: a sequence's middle tokens are written straight into the output when it has at least this many
DIRECT_MIN_TOKENS = 512
_STREAMS: dict[str, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    key = str(device)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device)
    return _STREAMS[key]


class _Events:
    """Device time between consecutive marks on the current stream (when timings are asked for)."""

    def __init__(self, timings: dict[str, float] | None, device: torch.device):
        self.on = timings is not None and device.type == "cuda"
        self.timings = timings
        self.marks: list[tuple[str, Any]] = []
        if self.on:
            self.mark("start")

    def mark(self, name: str) -> None:
        if self.on:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))

    def report(self) -> None:
        if self.on and self.timings is not None:
            for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
                key = f"gpu.{name}"
                self.timings[key] = self.timings.get(key, 0.0) + a.elapsed_time(b) / 1e3


class _Job:
    """One blob being restored: its checked header, sections, checksums in flight and decoded sections."""

    def __init__(self, codec: Any, coder: Any, header: container.Header, chunks: list, offsets: list, pinned: Any):
        self.codec, self.coder, self.header = codec, coder, header
        self.chunks, self.offsets, self.pinned = chunks, offsets, pinned
        self.device = codec.device
        self.pending: Any = None
        self.err = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.secs: dict[str, Any] = {}
        self.stream = _copy_stream(self.device)
        self.n = header.batch * header.middle_tokens

    def stage(self, values: bool) -> None:
        """Queue the copy and entropy decode of the values' sections (``values``) or of all the others."""
        idx = [i for i, s in enumerate(self.header.sections) if s.name.startswith("values.") == values]
        dev = [i for i in idx if self.header.sections[i].backend == NAME]
        for i in idx:
            s = self.header.sections[i]
            if s.backend != NAME:  # stored raw: checked and parsed on the host
                self.secs[s.name] = decode_stream(bytes(self.chunks[i]), s.backend, s.raw)
        if dev:
            pinned = None if self.pinned is None else (self.pinned, [self.offsets[i] for i in dev])
            st = self.coder.stage(
                [self.chunks[i] for i in dev], [self.header.sections[i].raw for i in dev], pinned, stream=self.stream
            )
            outs = self.coder.decode_device(st, self.err)
            self.secs.update({self.header.sections[i].name: t for i, t in zip(dev, outs)})
        if self.pending is None:  # checksums start once the first phase is queued: the host threads that run
            self.pending = crc32_submit(self.chunks)  # them would otherwise slow its parsing down

    def plan(self, kind: str) -> PlanLayout:
        cache = self.codec.__dict__.setdefault("_gpu_plan_cache", {})
        key = (self.header.ratio, kind)
        if key not in cache:
            cache[key] = PlanLayout.build(self.codec.calibration.plans[self.header.ratio][kind][0])
        return cache[key]

    def coefficients(self, kind: str) -> tuple[torch.Tensor, PlanLayout]:
        """The kind's coefficients on the device, as the reconstruction takes them (fp8: its E4M3 operand)."""
        pl = self.plan(kind)
        tr = self.codec._transform
        k = pl.components
        clock = stage_clock(None)
        if tr.fp8:
            args = (torch.float8_e4m3fn, tr.coefficient_columns(k), tr.fp8_column_scale(kind, 0, k))
        else:
            args = (tr.coefficient_dtype, tr.coefficient_columns(k), None)
        h = self.header
        return self.codec._quantizer.decode(f"{kind}.0", self.secs, pl, self.n, h.packing, clock, *args), pl

    def check(self) -> None:
        """Raise FormatError for a checksum mismatch or a corrupt entropy block (waits for the device)."""
        for s, crc in zip(self.header.sections, self.pending.result()):
            if crc != s.crc32:
                raise FormatError(f"section {s.name}: checksum mismatch; the blob is corrupt")
        self.coder.check(self.err)


def _open(codec: Any, blob: Any) -> _Job | None:
    """The restore of ``blob`` on this path, or None when it is not for this path."""
    cal = codec.calibration
    if cal is None or len(cal.columns) != 1 or codec._transform is None:
        return None
    coder = device_coder(NAME, codec.device)
    if coder is None or not hasattr(coder, "check"):
        return None
    p = cal.layout.num_features
    ordered = codec.__dict__.get("_gpu_ordered")
    if ordered is None:  # the single group must hold every feature in order (one layer = a column range)
        ordered = codec.__dict__["_gpu_ordered"] = bool(torch.equal(cal.columns[0].cpu(), torch.arange(p)))
    if not ordered:
        return None
    mv, pinned, header, body = codec._checked_header(blob)
    if (
        header.mode != "kvtc"
        or not header.middle_tokens
        or header.layout.max_tokens  # layers holding different tokens: the general path
        or any(s.backend not in (NAME, "raw") for s in header.sections)
    ):
        return None
    chunks, offsets = container.section_chunks(mv, header, body, codec._expected_sections(header))
    return _Job(codec, coder, header, chunks, offsets, pinned)


def _direct_views(full: torch.Tensor, s: int, w: int, m: int, dt: torch.dtype, out_dtype: torch.dtype) -> list | None:
    """Each sequence's ``[middle, features]`` view of ``full`` ``[B, T, ...]`` for the product to write into, or
    None (the rows then go through one temporary)."""
    if dt != out_dtype or not (s + w == 0 or m >= DIRECT_MIN_TOKENS):
        return None
    B, T = full.shape[:2]
    if s + w == 0:
        return [full.view(B * m, -1)]
    return [full[b, s : T - w].view(m, -1) for b in range(B)]


def decode(codec: Any, blob: Any, timings: dict[str, float] | None = None) -> KVSlice | None:
    """:meth:`Codec.decode` on this path (None: not for this path)."""
    t0 = time.perf_counter()
    job = _open(codec, blob)
    if job is None:
        return None
    ev = _Events(timings, job.device)
    h, tr, dev = job.header, codec._transform, job.device
    lay = h.layout
    B, T, m = h.batch, h.tokens, h.middle_tokens
    s, w = h.protected
    dt = DTYPES[lay.dtype]
    shape = (B, T, len(lay.layers), len(lay.heads), lay.head_dim)
    job.stage(values=False)
    ev.mark("entropy.keys")
    t_launch = time.perf_counter()
    positions = section_tensor(job.secs["positions"], torch.int64, (B, T), dev)
    out = {}
    for kind in KINDS:
        if kind == "values":
            job.stage(values=True)  # parsed and copied while the keys are reconstructed
            ev.mark("entropy.values")
        prot = section_tensor(job.secs[f"raw.{kind}"], dt, (B, s + w, *shape[2:]), dev)
        full = torch.empty(shape, dtype=dt, device=dev)
        full[:, :s] = prot[:, :s]
        full[:, T - w :] = prot[:, s:]
        coeffs, pl = job.coefficients(kind)
        ev.mark(f"dequantize.{kind}")
        views = _direct_views(full, s, w, m, dt, tr.out_dtype)
        rows = tr.reconstruct(kind, 0, coeffs, pl.components, views)
        if rows is not None:
            full[:, s : T - w] = rows.to(dt).reshape(B, m, *shape[2:])
        ev.mark(f"project.{kind}")
        out[kind] = full
        del coeffs, rows
    t_queued = time.perf_counter()
    job.check()
    ev.report()
    if timings is not None:
        timings.update({"parse": t_launch - t0, "queue": t_queued - t_launch, "verify": time.perf_counter() - t_queued})
    return KVSlice(lay, out["keys"], out["values"], positions, h.model_id)


def decode_layers(codec: Any, blob: Any) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]] | None:
    """:meth:`Codec.decode_layers` on this path (None: not for this path)."""
    job = _open(codec, blob)
    if job is None:
        return None
    return _layers(job)


def _layers(job: _Job) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    codec, h, dev = job.codec, job.header, job.device
    tr = codec._transform
    lay = h.layout
    B, T, m = h.batch, h.tokens, h.middle_tokens
    s, w = h.protected
    dt = DTYPES[lay.dtype]
    hd = (len(lay.heads), lay.head_dim)
    width = hd[0] * hd[1]
    job.stage(values=False)
    job.stage(values=True)
    prot = {k: section_tensor(job.secs[f"raw.{k}"], dt, (B, s + w, len(lay.layers), *hd), dev) for k in KINDS}
    coeffs = {k: job.coefficients(k) for k in KINDS}
    job.check()  # every section's checksum and entropy block, before anything is handed out
    for li, layer in enumerate(lay.layers):
        pair = []
        for kind in KINDS:
            full = torch.empty((B, T, *hd), dtype=dt, device=dev)
            full[:, :s] = prot[kind][:, :s, li]
            full[:, T - w :] = prot[kind][:, s:, li]
            c, pl = coeffs[kind]
            cols = (li * width, (li + 1) * width)
            views = _direct_views(full, s, w, m, dt, tr.out_dtype)
            rows = tr.reconstruct(kind, 0, c, pl.components, views, columns=cols)
            if rows is not None:
                full[:, s : T - w] = rows.to(dt).reshape(B, m, *hd)
            pair.append(full)
        yield layer, pair[0], pair[1]


__all__ = ["DIRECT_MIN_TOKENS", "decode", "decode_layers"]
