"""The GPU restore path of :class:`~kvtc.codec.codec.Codec`: a blob in (pinned) host memory -> a KV slice on the
GPU, its stages overlapped.

:meth:`Codec.decode` and :meth:`Codec.decode_layers` take this path for a ``kvtc`` blob coded with ``huff4k``
(sections stored raw are fine too) and one PCA group, decoded onto the codec's CUDA device; anything else takes the
general path. The blob's sections are read in phases: keys (with the positions and protected tokens), then values.
Each phase's coded words go to the device on a copy stream, straight from the pinned blob; its entropy decode and
unpack+dequantize are queued on a "prep" stream behind them, and the products on the caller's stream behind those.
The host parses a phase's streams while the device works on the previous one, and the prep stream's short kernels
run beside the previous phase's product (staging the keys in two parts, the first components' product starting
while the rest are still copied, gained nothing on an H200: the products alone fill the time,
docs/studies/restore-gemm.md). Nothing waits for the device in between: the
entropy decoder raises a device flag on a corrupt block, and the CRC-32 of every section runs on host threads
meanwhile (started once the first phase is queued, so that they do not compete with its parsing); both are checked
before anything is returned (:meth:`Codec.decode`) or yielded (:meth:`Codec.decode_layers`, which queues the same
products, one per kind, and checks waiting for the decode but not for the products: each layer is handed over as a
view of the output while the device is still computing it, so an engine queues its own work on layer 0 behind the
products without a gap).

The fp8 reconstruction takes its operand straight from the unpack+dequantize kernel (coefficients divided by their
components' standard deviations, written as E4M3; :class:`~kvtc.codec.transform.PCATransform`); a sequence's
middle tokens are written by the product straight into the output when it has enough of them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from ..calibration.artifact import KINDS
from ..coding.buffers import section_tensor
from ..coding.entropy import decode_stream, device_coder
from ..coding.huffman import NAME
from ..coding.quantizer import PlanLayout, plan_layouts
from ..errors import FormatError
from ..layout import DTYPES, KVSlice
from . import container, crc

#: a sequence's middle tokens are written straight into the output when it has at least this many
DIRECT_MIN_TOKENS = 512
#: the phases of a restore, in order: (phase, the kind whose coefficients it decodes; "" for positions and
#: protected tokens, needed only once the keys' product is queued)
_PHASES = (("keys", "keys"), ("rest", ""), ("values", "values"))
_STREAMS: dict[tuple[str, str], torch.cuda.Stream] = {}


def _stream(device: torch.device, role: str) -> Any:
    """This device's stream for ``role``: "copy" (host to device copies) or "prep" (entropy decode and
    dequantize, high priority: its short kernels go ahead of the products queued on the current stream)."""
    if device.type != "cuda":
        return None
    key = (str(device), role)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device, priority=-1 if role == "prep" else 0)
    return _STREAMS[key]


def _on(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


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


def _phase_of(name: str) -> str:
    """The phase prefix a section belongs to: "keys.", "values." or "rest." (positions, protected tokens)."""
    return name[: name.index(".") + 1] if name.startswith(("keys.", "values.")) else "rest."


def _crc_threads() -> int:
    return max(2, min(32, os.cpu_count() or 2))


class _Job:
    """One blob being restored: its checked header, sections, checksums in flight and decoded sections.

    Phases: :data:`_PHASES`."""

    def __init__(self, codec: Any, coder: Any, header: container.Header, chunks: list, offsets: list, pinned: Any):
        self.codec, self.coder, self.header = codec, coder, header
        self.chunks, self.offsets, self.pinned = chunks, offsets, pinned
        self.device = codec.device
        self.pending: Any = None
        self.err = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.flag: Any = None  # the corruption flag in pinned host memory, once copied there (flag_ready)
        self.flagged: Any = None  # the event after that copy
        self.secs: dict[str, Any] = {}
        self.stream = _stream(self.device, "copy")
        self.prep: Any = None  # the stream decode and dequantize run on (None: the current one)
        self.main: Any = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.n = header.batch * header.middle_tokens
        self.coeffs: dict[str, torch.Tensor] = {}
        self.host: dict[str, float] = {}  # host seconds of each phase's staging

    def stage(self, phase: str) -> None:
        """Queue the copy and entropy decode of ``phase``'s sections (see the class)."""
        t0 = time.perf_counter()
        h = self.header
        if phase == "rest" and self.pending is None:  # checksums on host threads from here on: the keys'
            total = sum(len(c) for c in self.chunks)  # parsing, which the first product waits for, is done
            piece = max(crc.PIECE, -(-total // _crc_threads()))  # one piece per thread: the lock taken rarely
            self.pending = crc.crc32_submit(self.chunks, piece=piece)
        idx = [i for i, s in enumerate(h.sections) if _phase_of(s.name) == phase + "."]
        dev = [i for i in idx if h.sections[i].backend == NAME]
        for i in idx:
            s = h.sections[i]
            if s.backend != NAME:  # stored raw: checked and parsed on the host
                self.secs[s.name] = decode_stream(bytes(self.chunks[i]), s.backend, s.raw)
        if dev:
            pinned = None if self.pinned is None else (self.pinned, [self.offsets[i] for i in dev])
            with _on(self.prep):
                st = self.coder.stage(
                    [self.chunks[i] for i in dev], [h.sections[i].raw for i in dev], pinned, stream=self.stream
                )
                buf = torch.empty(max(st["out_bytes"], 16), dtype=torch.uint8, device=self.device)
                self._used_on_main(buf)
                outs = self.coder.decode_device(st, self.err, out=buf)
            self.secs.update({h.sections[i].name: t for i, t in zip(dev, outs)})
        self.host[f"host.{phase}"] = time.perf_counter() - t0

    def _used_on_main(self, t: torch.Tensor) -> None:
        """``t`` is made on the prep stream and read on the current one: its memory waits for that too."""
        if self.prep is not None and self.main is not None:
            t.record_stream(self.main)

    def plan(self, kind: str) -> PlanLayout:
        return plan_layouts(self.codec.calibration, self.header.ratio)[kind][0]

    def coefficients(self, kind: str) -> tuple[torch.Tensor, PlanLayout]:
        """The kind's coefficients on the device, as the reconstruction takes them (fp8: its E4M3 operand), on
        the prep stream."""
        pl = self.plan(kind)
        tr = self.codec._transform
        k = pl.components
        with _on(self.prep):
            cols, dtype = tr.coefficient_columns(k), torch.float8_e4m3fn if tr.fp8 else tr.coefficient_dtype
            self.coeffs[kind] = torch.zeros((self.n, cols), dtype=dtype, device=self.device)
            self._used_on_main(self.coeffs[kind])
            scale = tr.fp8_column_scale(kind, 0, k) if tr.fp8 else None
            self.codec._quantizer.dequantize(f"{kind}.0", self.secs, pl, self.coeffs[kind], self.header.packing, scale)
        return self.coeffs[kind], pl

    def ready(self) -> None:
        """The current stream waits for what is queued on the prep stream so far."""
        if self.prep is not None and self.main is not None:
            ev = torch.cuda.Event()
            ev.record(self.prep)
            self.main.wait_event(ev)

    def flag_ready(self) -> None:
        """Copy the entropy decoder's corruption flag to pinned host memory behind what is queued so far, so that
        :meth:`check` waits for the decode alone, not for the products queued after it."""
        if self.device.type == "cuda":
            self.flag = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self.flag.copy_(self.err, non_blocking=True)
            self.flagged = torch.cuda.Event()
            self.flagged.record()

    def check(self) -> None:
        """Raise FormatError for a checksum mismatch or a corrupt entropy block (waits for the device: for the
        decode alone after :meth:`flag_ready`, else for everything queued)."""
        for s, got in zip(self.header.sections, self.pending.result()):
            if got != s.crc32:
                raise FormatError(f"section {s.name}: checksum mismatch; the blob is corrupt")
        if self.flag is not None:
            self.flagged.synchronize()
        self.coder.check(self.err if self.flag is None else self.flag)


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
        or header.adaptive  # token-adaptive rates: the general path
        or any(s.backend not in (NAME, "raw") for s in header.sections)
        or (
            header.sections and header.sections[-1].name == container.PAD_SECTION
        )  # a padded (all-zero) cache: the general path
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


def _targets(full: torch.Tensor, s: int, w: int, m: int, dt: torch.dtype, tr: Any) -> tuple[list, bool]:
    """Where the product writes its rows: each sequence's middle tokens in ``full`` (True) or one temporary
    (False: copied into ``full`` afterwards)."""
    views = _direct_views(full, s, w, m, dt, tr.out_dtype)
    if views is not None:
        return views, True
    B = full.shape[0]
    return [torch.empty((B * m, full[0, 0].numel()), dtype=tr.out_dtype, device=full.device)], False


def _project(job: _Job, kind: str, targets: list) -> None:
    """Queue the product of ``kind``'s coefficients into ``targets``."""
    job.codec._transform.reconstruct(kind, 0, job.coeffs[kind], job.plan(kind).components, targets)


def decode(codec: Any, blob: Any, timings: dict[str, float] | None = None) -> KVSlice | None:
    """:meth:`Codec.decode` on this path (None: not for this path)."""
    t0 = time.perf_counter()
    job = _open(codec, blob)
    if job is None:
        return None
    return _decode(job, timings, t0, hand_over=False)


def decode_layers(codec: Any, blob: Any) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]] | None:
    """:meth:`Codec.decode_layers` on this path (None: not for this path)."""
    job = _open(codec, blob)
    if job is None:
        return None
    return _layers(job)


def _layers(job: _Job) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """:func:`decode`'s products (one per kind: 32 per-layer products of a Llama-3.1-8B-shaped cache took 128 ms
    where the two whole ones take about 100), each layer handed over as a view of the output once the checks pass,
    while the device may still be computing it."""
    kv = _decode(job, None, time.perf_counter(), hand_over=True)
    for li, layer in enumerate(kv.layout.layers):
        yield layer, kv.keys[:, :, li], kv.values[:, :, li]


def _decode(job: _Job, timings: dict[str, float] | None, t0: float, hand_over: bool) -> KVSlice:
    """Queue the whole restore and check the blob. ``hand_over``: the checks wait for the entropy decode alone,
    not for the products queued after it (the caller queues its own work behind them)."""
    t_open = time.perf_counter()
    job.prep = _stream(job.device, "prep")
    if job.prep is not None:
        job.prep.wait_stream(job.main)  # what the caller queued (and the error flag's zeros) comes first
    ev = _Events(timings, job.device)
    h, tr, dev = job.header, job.codec._transform, job.device
    lay = h.layout
    B, T, m = h.batch, h.tokens, h.middle_tokens
    s, w = h.protected
    dt = DTYPES[lay.dtype]
    shape = (B, T, len(lay.layers), len(lay.heads), lay.head_dim)
    out = {kind: torch.empty(shape, dtype=dt, device=dev) for kind in KINDS}
    t_first = None
    for phase, kind in _PHASES:  # what the prep stream decodes, then what the current stream projects
        job.stage(phase)
        if phase == "rest":  # protected tokens: rows the products do not write
            job.ready()
            for k in KINDS:
                prot = section_tensor(job.secs[f"raw.{k}"], dt, (B, s + w, *shape[2:]), dev)
                out[k][:, :s] = prot[:, :s]
                out[k][:, T - w :] = prot[:, s:]
            ev.mark("rest")
            continue
        job.coefficients(kind)
        job.ready()
        if t_first is None:
            t_first = time.perf_counter()
        ev.mark(f"wait.{phase}")
        targets, direct = _targets(out[kind], s, w, m, dt, tr)
        _project(job, kind, targets)
        if not direct:
            out[kind][:, s : T - w] = targets[0].to(dt).reshape(B, m, *shape[2:])
        ev.mark(f"project.{phase}")
    positions = section_tensor(job.secs["positions"], torch.int64, (B, T), dev)
    t_queued = time.perf_counter()
    if hand_over:
        with _on(job.prep):
            job.flag_ready()
    job.check()  # every section's checksum and entropy block, before anything is returned
    ev.report()
    if timings is not None:
        timings.update(job.host)
        timings.update(
            {
                "open": t_open - t0,
                "first_queued": t_first - t_open,
                "queue": t_queued - t_first,
                "verify": time.perf_counter() - t_queued,
            }
        )
    return KVSlice(lay, out["keys"], out["values"], positions, h.model_id)


__all__ = ["DIRECT_MIN_TOKENS", "decode", "decode_layers"]
