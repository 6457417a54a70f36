"""``Codec``: KV slice <-> bytes, with a calibration and a target ratio.

Encode, per sequence: the ``sinks`` oldest and ``window`` newest tokens are stored raw; every other token
("middle") of keys and values is projected on its PCA group's basis, quantized by the bit plan, packed into
component-major planes and entropy coded. Decode reverses it; :meth:`Codec.decode_layers` yields one layer
at a time so an engine can start on layer 0 before the rest is reconstructed.

Sections of a ``kvtc`` blob, in order: ``positions`` (int64 ``[B, T]``), ``raw.keys`` and ``raw.values``
(protected tokens ``[B, s+w, L, H, D]`` in the slice dtype), then for ``kind`` in keys, values and PCA group
``g``: ``{kind}.{g}.params`` (fp16 ``[R, N]``: each kept group's per-token range parameters in plan order, a
row of N tokens each: shift then scale, or the scale alone for a scale-only type) and ``{kind}.{g}.{type}``
(packed planes, component order) for each type the plan uses, in :data:`CODED_TYPES` order.
An ``identity`` blob stores every token in ``raw.*`` and needs no calibration.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..calibration.artifact import KINDS, Calibration, ratio_key
from ..calibration.dp import Plan
from ..errors import CalibrationMismatch, FormatError, LayoutError
from ..layout import DTYPES, KVLayout, KVSlice
from . import container
from . import huffman
from . import nvcomp as gpu_entropy
from .entropy import DEFAULT_BACKEND, Precoded, get_backend
from .. import kernels
from .packing import PACKINGS, pack, packed_plane_bytes, unpack
from ..quant import (DROP, FP8, FP8S, INT2, INT2S, INT3, INT3S, INT4, INT4S, TYPE_BITS, TYPE_NAMES, dequantize,
                     param_rows, quantize)

#: the paper's protected tokens: 4 attention sinks, 128 most recent tokens
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 128
#: stream order in a blob (the paper's types first: a blob that uses only them is laid out as before ours existed)
CODED_TYPES = (INT2, INT4, FP8, INT3, INT2S, INT3S, INT4S, FP8S)
#: projection arithmetic on CUDA: "fp32" (the reference's, no TF32), "bf16" (tensor cores, fp32 accumulate) or
#: "fp8" (E4M3 operands with per-row and per-column float32 scales, fp32 accumulate: twice bf16's rate on Hopper;
#: adds about 1e-3 relative squared error to the projection). The CPU path always computes in fp32.
PRECISIONS = ("fp32", "bf16", "fp8")


@dataclass
class _Bucket:
    """Kept groups of one (type, size): where their components go in the plane and in the params."""

    qtype: int
    size: int
    columns: torch.Tensor  # [n, size] component indices
    plane_rows: torch.Tensor  # [n * size] rows of the type's plane, component-major
    param_rows: torch.Tensor  # [n] first row of each group in the params stream (its shift, or its scale)
    clips: torch.Tensor | None = None  # [n] float32 encoder clips (None: all 1)

    def device_clips(self, device: torch.device) -> torch.Tensor | None:
        if self.clips is None:
            return None
        cache = self.__dict__.setdefault("_clips", {})
        if str(device) not in cache:
            cache[str(device)] = self.clips.to(device).contiguous()
        return cache[str(device)]

    def starts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int32 (first column, first plane row, params row) of each group, for the fused kernels."""
        key = str(device)
        cache = self.__dict__.setdefault("_starts", {})
        if key not in cache:
            cache[key] = tuple(t.to(device, torch.int32).contiguous() for t in
                               (self.columns[:, 0], self.plane_rows.view(-1, self.size)[:, 0], self.param_rows))
        return cache[key]


@dataclass
class _PlanLayout:
    plan: Plan
    components: int  # basis rows the plan uses
    kept_groups: int
    param_rows: int  # rows of the params stream
    plane_sizes: dict[int, int]  # type -> components in its plane
    buckets: list[_Bucket]

    @classmethod
    def build(cls, plan: Plan) -> _PlanLayout:
        kept = [(start, size, t) for start, size, t in plan.groups() if t != DROP]
        plane_sizes = {t: 0 for t in CODED_TYPES}
        plane_row_of: list[int] = []
        param_row_of: list[int] = []
        prows = 0
        for _, size, t in kept:
            plane_row_of.append(plane_sizes[t])
            plane_sizes[t] += size
            param_row_of.append(prows)
            prows += param_rows(t)
        by: dict[tuple[int, int], list[int]] = {}
        for gi, (_, size, t) in enumerate(kept):
            by.setdefault((t, size), []).append(gi)
        clips = plan.kept_clips()
        buckets = []
        for (t, size), gis in sorted(by.items()):
            cl = torch.tensor([clips[g] for g in gis], dtype=torch.float32)
            starts = torch.tensor([kept[g][0] for g in gis], dtype=torch.int64)
            offs = torch.arange(size, dtype=torch.int64)
            rows0 = torch.tensor([plane_row_of[g] for g in gis], dtype=torch.int64)
            buckets.append(
                _Bucket(t, size, starts[:, None] + offs, (rows0[:, None] + offs).reshape(-1),
                        torch.tensor([param_row_of[g] for g in gis], dtype=torch.int64),
                        cl if bool((cl != 1.0).any()) else None)
            )
        return cls(plan, plan.kept_components, len(kept), prows, {t: n for t, n in plane_sizes.items() if n}, buckets)


class Codec:
    """KVTC encoder/decoder for one calibration and target ratio.

    ``Codec(calibration, ratio=16)``; ``encode(slice) -> bytes``; ``decode(bytes) -> KVSlice``;
    ``inspect(bytes) -> dict``. ``Codec.identity()`` stores raw tokens through the same container.
    """

    def __init__(
        self,
        calibration: Calibration | None,
        ratio: float | None = 16,
        sinks: int = DEFAULT_SINKS,
        window: int = DEFAULT_WINDOW,
        backend: str = DEFAULT_BACKEND,
        packing: str = "bits",
        device: torch.device | str = "cpu",
        precision: str = "fp32",
        max_decoded_bytes: int = container.DEFAULT_MAX_DECODED_BYTES,
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}")
        if sinks < 0 or window < 0:
            raise ValueError("sinks and window must be non-negative")
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}")
        get_backend(backend)
        self.calibration = calibration
        self.mode = "identity" if calibration is None else "kvtc"
        self.ratio = None if calibration is None else ratio_key(ratio if ratio is not None else 16)
        self.sinks, self.window = sinks, window
        self.backend, self.packing = backend, packing
        self.device = torch.device(device)
        self.precision = precision
        #: a blob declaring more decoded bytes than this (or more than it can honestly hold) is refused
        self.max_decoded_bytes = int(max_decoded_bytes)
        self._fused = self.device.type == "cuda" and kernels.available(self.device)
        self._fp8 = self._fused and precision == "fp8"
        if self._fp8 and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError("precision='fp8' needs a GPU with fp8 tensor cores (compute capability 8.9 or newer)")
        self._plans: dict[str, list[_PlanLayout]] = {}
        self._bases: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if calibration is not None:
            plans = calibration.plans_for(self.ratio)
            self._plans = {kind: [_PlanLayout.build(p) for p in plans[kind]] for kind in KINDS}

    @classmethod
    def identity(cls, backend: str = "raw", **kw: Any) -> Codec:
        """Stores every token raw in the container (debugging, lossless reference paths)."""
        return cls(None, None, backend=backend, **kw)

    # ------------------------------------------------------------------ helpers
    def _side(self, kind: str, g: int, decode: bool) -> bool:
        """Whether the decode basis differs from the encode one (sensitivity-weighted groups only): the cache
        keys on this, so an unweighted codec holds one copy of each basis for both directions."""
        return decode and self.calibration.pcas[kind][g].scale is not None  # type: ignore[union-attr]

    def _basis(self, kind: str, g: int, k: int, decode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        decode = self._side(kind, g, decode)
        mean, basis = self._basis_fp32(kind, g, decode)
        if self._fused and self.precision == "bf16":
            bkey = (kind, g, "bf16", decode)
            if bkey not in self._bases:
                self._bases[bkey] = (mean, basis.to(torch.bfloat16))
            basis = self._bases[bkey][1]
        return mean, basis[:k]

    def _fp8_basis(self, kind: str, g: int, k: int, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``k`` basis rows in E4M3 with their scales, padded with zero rows to a multiple of
        :data:`_FP8_ALIGN` components (fp8 matmuls need 16; on the H200 a count that is 16 mod 32 runs ~30% slower,
        ``benchmarks/fp8_alignment.py``). ``transposed=False``: ``[p, k16]`` column-major with per-component scales ``[1, k16]``
        (for the projection); ``True``: ``[k16, p]`` column-major with per-feature scales ``[1, p]``."""
        key = (kind, g, "fp8", k, transposed)
        if key not in self._bases:
            _, basis = self._basis_fp32(kind, g, decode=transposed)
            k16 = -(-k // _FP8_ALIGN) * _FP8_ALIGN
            b = torch.zeros((k16, basis.shape[1]), dtype=torch.float32, device=self.device)
            b[:k] = basis[:k]
            if not transposed:
                scale = (b.abs().amax(dim=1) / _FP8_MAX).clamp(min=1e-30)
                q = (b / scale[:, None]).to(torch.float8_e4m3fn)  # [k16, p] row-major = [p, k16] column-major
                self._bases[key] = (q.T, scale[None, :].contiguous())
            else:
                scale = (b.abs().amax(dim=0) / _FP8_MAX).clamp(min=1e-30)
                q = (b / scale[None, :]).T.contiguous().to(torch.float8_e4m3fn)  # [p, k16] row-major
                self._bases[key] = (q.T, scale[None, :].contiguous())
        return self._bases[key]

    def _basis_fp32(self, kind: str, g: int, decode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, basis)`` in feature units: the projection's (encode) or the reconstruction's (decode); they
        differ only for a sensitivity-weighted calibration (:meth:`PCAResult.coder_basis`)."""
        decode = self._side(kind, g, decode)
        key = (kind, g, decode)
        if key not in self._bases:
            pca = self.calibration.pcas[kind][g]  # type: ignore[union-attr]
            mean, basis = pca.coder_basis(decode)
            self._bases[key] = (mean.to(self.device), basis.contiguous().to(self.device))
        return self._bases[key]

    def _project(self, x: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor,
                 fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``(x − µ) @ basisᵀ`` in the codec's precision (fp32: the reference arithmetic, TF32 off)."""
        if fp8 is not None:
            a, sa = _fp8_rows(x.to(torch.bfloat16) - mean.to(torch.bfloat16))
            out = torch._scaled_mm(a, fp8[0], scale_a=sa, scale_b=fp8[1], out_dtype=torch.bfloat16)
            return out[:, : basis.shape[0]].float()
        if self._fused and self.precision == "bf16":
            return _mm_f32((x.to(torch.bfloat16) - mean.to(torch.bfloat16)), basis.T)
        with _no_tf32():
            return (x.float() - mean) @ basis.T

    def _reconstruct_dtype(self) -> torch.dtype:
        """The dtype :meth:`_reconstruct` produces."""
        return torch.bfloat16 if self._fp8 or (self._fused and self.precision == "bf16") else torch.float32

    def _reconstruct(self, coeffs: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor,
                     fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                     out: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """``coeffs @ basis + µ`` in the codec's precision. ``out``: ``[rows, features]`` tensors of
        :meth:`_reconstruct_dtype` that take consecutive blocks of the rows (then None is returned)."""
        if fp8 is not None:
            k16 = fp8[0].shape[0]
            c = coeffs if coeffs.shape[1] == k16 else torch.nn.functional.pad(coeffs, (0, k16 - coeffs.shape[1]))
            a, sa = _fp8_rows(c)
            mean16 = mean.to(torch.bfloat16)
            if out is None:
                res = torch._scaled_mm(a, fp8[0], scale_a=sa, scale_b=fp8[1], out_dtype=torch.bfloat16)
                return res.add_(mean16)
            r0 = 0
            for o in out:
                r1 = r0 + o.shape[0]
                # cuBLASLt wants 16-byte aligned scale pointers: a block starting at a row that is not a multiple of
                # 4 gets its own copy of the (tiny) row-scale vector; its fp8 rows are k16 bytes each, always aligned
                sa_blk = sa[r0:r1] if r0 % 4 == 0 else sa[r0:r1].clone()
                res = torch._scaled_mm(a[r0:r1], fp8[0], scale_a=sa_blk, scale_b=fp8[1], out_dtype=torch.bfloat16)
                torch.add(res, mean16, out=o)
                r0 = r1
            return None
        if self._fused and self.precision == "bf16":
            mean, coeffs = mean.to(torch.bfloat16), coeffs.to(torch.bfloat16)
        if out is None:
            with _no_tf32():
                return torch.addmm(mean, coeffs, basis)
        r0 = 0
        with _no_tf32():
            for o in out:
                torch.addmm(mean, coeffs[r0 : r0 + o.shape[0]], basis, out=o)
                r0 += o.shape[0]
        return None

    def _split(self, t: torch.Tensor, s: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T, ...]`` -> (protected ``[B, s+w, ...]``, middle ``[B, T-s-w, ...]``)."""
        T = t.shape[1]
        prot = torch.cat([t[:, :s], t[:, T - w :]], dim=1) if w else t[:, :s]
        return prot, t[:, s : T - w]

    # ------------------------------------------------------------------ encode
    def encode(self, kv: KVSlice, timings: dict[str, float] | None = None, out: Any = None) -> Any:
        """Compress a slice (keys pre-RoPE) to a self-describing blob (``bytes``).

        ``out``: a buffer the blob is written into instead (a 1-D uint8 CPU tensor such as a pinned host buffer
        an offload tier reuses, or a bytearray / writable memoryview / numpy array); the blob is returned as a view
        of its first bytes (a tensor slice for a tensor, else a memoryview), which :meth:`decode` accepts as is.
        Writing into memory already touched skips the page faults a fresh ``bytes`` of that size costs. A buffer
        too small raises :class:`~kvtc.errors.OutputBufferError` (its ``needed`` says how large) and is left
        untouched."""
        kv.validate()
        lay = kv.layout
        if kv.keys.dtype != lay.torch_dtype:
            raise LayoutError(f"slice tensors are {kv.keys.dtype}, its layout says {lay.dtype}")
        clock = _Clock(timings)
        B, T = kv.batch, kv.num_tokens
        if self.calibration is not None:
            self.calibration.check_layout(lay)
        if self.calibration is not None and B > 0:
            sinks, window = self.sinks, self.window
        else:  # identity, or an empty batch: every (possibly zero) token is stored raw
            sinks, window = T, 0
        header = container.Header(
            mode=self.mode,
            calibration=None if self.calibration is None else self.calibration.hash,
            model_id=kv.model_id,
            layout=lay,
            batch=B,
            tokens=T,
            sinks=sinks,
            window=window,
            ratio=self.ratio,
            packing=self.packing,
        )
        s, w = header.protected
        payloads: list[tuple[str, Any]] = [("positions", _le_bytes(kv.positions))]
        for kind, t in (("keys", kv.keys), ("values", kv.values)):
            prot, _ = self._split(t, s, w)
            payloads.append((f"raw.{kind}", _device_bytes_view(prot) if self._on_fused_device(prot) else _le_bytes(prot)))
        if self.calibration is not None and header.middle_tokens:
            for kind, t in (("keys", kv.keys), ("values", kv.values)):
                _, mid = self._split(t, s, w)
                with clock("to_rows"):
                    rows = mid.reshape(-1, lay.num_features).to(self.device)
                    if not (self._fused and self.precision in ("bf16", "fp8")):
                        rows = rows.float()
                payloads.extend(self._encode_rows(kind, rows, clock))
        with clock("entropy"):
            payloads = self._host_payloads(payloads, clock)
            return container.write(header, payloads, self.backend, timings, out)

    def _on_fused_device(self, t: torch.Tensor) -> bool:
        return self._fused and t.device.type == "cuda"

    def _host_payloads(self, payloads: list[tuple[str, Any]], clock: _Clock) -> list[tuple[str, Any]]:
        """Device-resident payloads -> entropy-coded on the GPU (when the backend has a GPU coder) or copied
        to host bytes; what the container writes is the same either way."""
        dev = [i for i, (_, d) in enumerate(payloads) if isinstance(d, torch.Tensor)]
        if not dev:
            return payloads
        out = list(payloads)
        coder = _device_coder(self.backend, self.device)
        if coder is not None:
            with clock("gpu_entropy"):
                code = getattr(coder, "compress_parts", coder.compress)
                coded = code([payloads[i][1] for i in dev])
            for i, c in zip(dev, coded):
                name, d = payloads[i]
                out[i] = (name, Precoded(self.backend, c, d.numel(), lambda d=d: _host_bytes(d)))
        else:
            with clock("to_host"):
                for i in dev:
                    out[i] = (payloads[i][0], _host_bytes(payloads[i][1]))
        return out

    def _encode_rows(self, kind: str, rows: torch.Tensor, clock: _Clock) -> list[tuple[str, bytes]]:
        out = []
        n = rows.shape[0]
        cols_all = self.calibration.columns  # type: ignore[union-attr]
        for g, pl in enumerate(self._plans[kind]):
            with clock("project"):
                x = rows if len(cols_all) == 1 else rows[:, cols_all[g].to(rows.device)]
                mean, basis = self._basis(kind, g, pl.components)
                fp8 = self._fp8_basis(kind, g, pl.components, False) if self._fp8 else None
                coeffs = self._project(x, mean, basis, fp8)
            if self._fused:
                with clock("quantize"):
                    params = torch.empty((pl.param_rows, n), dtype=torch.float16, device=rows.device)
                    planes = {t: torch.empty((c, packed_plane_bytes(n, TYPE_BITS[t], self.packing)), dtype=torch.uint8,
                                             device=rows.device) for t, c in pl.plane_sizes.items()}
                    for b in pl.buckets:
                        kernels.quantize_pack(coeffs, *b.starts(rows.device), b.qtype, b.size, params,
                                              planes[b.qtype], self.packing, b.device_clips(rows.device))
                out.append((f"{kind}.{g}.params", params.view(torch.uint8).reshape(-1)))
                out.extend((f"{kind}.{g}.{TYPE_NAMES[t]}", planes[t].reshape(-1)) for t in CODED_TYPES if t in planes)
                continue
            with clock("quantize"):
                params = torch.empty((pl.param_rows, n), dtype=torch.float16, device=rows.device)
                planes = {t: torch.empty((c, n), dtype=torch.uint8, device=rows.device) for t, c in pl.plane_sizes.items()}
                for b in pl.buckets:
                    x = coeffs[:, b.columns.to(rows.device)]  # [n, groups, size]
                    sym, shift, scale = quantize(x, b.qtype, 1.0 if b.clips is None else b.clips)
                    pr = b.param_rows.to(rows.device)
                    if param_rows(b.qtype) == 2:
                        params[pr] = shift.T
                        params[pr + 1] = scale.T
                    else:
                        params[pr] = scale.T
                    planes[b.qtype][b.plane_rows.to(rows.device)] = sym.permute(1, 2, 0).reshape(-1, n)
            with clock("pack"):
                out.append((f"{kind}.{g}.params", _le_bytes(params)))
                for t in CODED_TYPES:
                    if t in planes:
                        out.append((f"{kind}.{g}.{TYPE_NAMES[t]}", _le_bytes(pack(planes[t].cpu(), TYPE_BITS[t], self.packing))))
        return out

    # ------------------------------------------------------------------ decode
    def _open(self, blob: bytes | torch.Tensor, on_device: bool = False,
              deferred: list[Any] | None = None) -> tuple[container.Header, dict[str, Any]]:
        pinned = None
        if isinstance(blob, torch.Tensor):  # a blob held in (pinned) host memory as a uint8 tensor
            if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.device.type != "cpu":
                raise FormatError("a tensor blob must be a 1-D uint8 CPU tensor (e.g. pinned host memory)")
            pinned = blob if blob.is_pinned() else None
            blob = memoryview(blob.numpy())
        header, body = container.read_header(blob)
        container.check_budget(header, len(blob), self.max_decoded_bytes)
        if header.mode == "kvtc":
            cal = self.calibration
            if cal is None or header.calibration != cal.hash:
                raise CalibrationMismatch(
                    f"blob was encoded with calibration {str(header.calibration)[:16]}, this codec has "
                    f"{'none' if cal is None else cal.fingerprint}; decode with the calibration that encoded it"
                )
            cal.check_layout(header.layout)
            if header.ratio is None or header.ratio not in cal.plans:
                raise FormatError(f"blob names ratio {header.ratio!r}, which its calibration has no plan for")
        expected = self._expected_sections(header)
        if on_device and self._fused:
            for name in dict.fromkeys(x.backend for x in header.sections):
                coder = _device_coder(name, self.device)
                if coder is not None:
                    return header, container.read_sections(blob, header, body, expected, coder, name, pinned,
                                                           deferred)
        return header, container.read_sections(blob, header, body, expected)

    def _expected_sections(self, h: container.Header) -> dict[str, int]:
        lay = h.layout
        esize = torch.empty((), dtype=DTYPES[lay.dtype]).element_size()
        s, w = h.protected
        exp = {"positions": 8 * h.batch * h.tokens}
        for kind in KINDS:
            exp[f"raw.{kind}"] = h.batch * (s + w) * lay.num_features * esize
        if h.mode == "kvtc" and h.middle_tokens:
            n = h.batch * h.middle_tokens
            plans = {kind: [_PlanLayout.build(p) for p in self.calibration.plans[h.ratio][kind]] for kind in KINDS}  # type: ignore[union-attr,index]
            for kind in KINDS:
                for g, pl in enumerate(plans[kind]):
                    exp[f"{kind}.{g}.params"] = pl.param_rows * n * 2
                    for t in CODED_TYPES:
                        if t in pl.plane_sizes:
                            exp[f"{kind}.{g}.{TYPE_NAMES[t]}"] = pl.plane_sizes[t] * packed_plane_bytes(n, TYPE_BITS[t], h.packing)
        return exp

    def decode(self, blob: bytes | torch.Tensor, timings: dict[str, float] | None = None,
               device: torch.device | str | None = None) -> KVSlice:
        """Reconstruct the slice a blob holds (keys pre-RoPE, in the layout's dtype), on ``device``
        (default: CPU). ``blob``: bytes, or a 1-D uint8 CPU tensor holding them (pinned host memory lets a GPU
        codec copy the coded streams to the device without staging)."""
        clock = _Clock(timings)
        out_dev = torch.device(device) if device is not None else torch.device("cpu")
        checks: list[Any] = []  # checksums still running on host threads (GPU path): verified before returning
        with clock("parse"):
            header, secs = self._open(blob, on_device=True, deferred=checks)
        lay = header.layout
        B, T = header.batch, header.tokens
        s, w = header.protected
        dt = DTYPES[lay.dtype]
        shape = (B, T, len(lay.layers), len(lay.heads), lay.head_dim)
        positions = _section(secs["positions"], torch.int64, (B, T), out_dev)
        out = {}
        for kind in KINDS:
            prot = _section(secs[f"raw.{kind}"], dt, (B, s + w, *shape[2:]), out_dev)
            full = torch.empty(shape, dtype=dt, device=out_dev)
            full[:, :s] = prot[:, :s]
            full[:, T - w :] = prot[:, s:]
            if header.middle_tokens:
                m = header.middle_tokens
                # the projection writes each sequence's middle tokens straight into the output where it can
                # (one PCA group, output on the codec's device in the projection's dtype): no extra pass
                direct = (self._fused and out_dev == self.device and len(self.calibration.columns) == 1  # type: ignore[union-attr]
                          and dt == self._reconstruct_dtype() and (s + w == 0 or m >= DIRECT_MIN_TOKENS))
                views = None
                if direct:  # one view when nothing is protected, else one per sequence
                    views = ([full.view(B * m, -1)] if s + w == 0 else
                             [full[b, s : T - w].view(m, -1) for b in range(B)])
                rows = self._decode_rows(kind, header, secs, clock, views)
                if rows is not None:
                    with clock("to_tokens"):
                        full[:, s : T - w] = rows.to(dt).to(out_dev).reshape(B, m, *shape[2:])
            out[kind] = full
        with clock("verify"):
            for check in checks:
                check()
        return KVSlice(lay, out["keys"], out["values"], positions, header.model_id)

    def _coefficients(self, kind: str, g: int, header: container.Header, secs: dict[str, bytes],
                      clock: _Clock) -> tuple[torch.Tensor, _PlanLayout]:
        n = header.batch * header.middle_tokens
        pl = _PlanLayout.build(self.calibration.plans[header.ratio][kind][g])  # type: ignore[union-attr,index]
        if self._fused:
            with clock("unpack"):
                params = _section(secs[f"{kind}.{g}.params"], torch.float16, (pl.param_rows, n), self.device)
                planes = {t: _section(secs[f"{kind}.{g}.{TYPE_NAMES[t]}"], torch.uint8,
                                      (c, packed_plane_bytes(n, TYPE_BITS[t], header.packing)), self.device)
                          for t, c in pl.plane_sizes.items()}
            with clock("dequantize"):
                cdt = torch.bfloat16 if self.precision == "bf16" else torch.float32
                # fp8 matmuls want a padded component count (_FP8_ALIGN): the extra columns stay zero
                kc = -(-pl.components // _FP8_ALIGN) * _FP8_ALIGN if self._fp8 else pl.components
                coeffs = torch.zeros((n, kc), dtype=cdt, device=self.device)
                for b in pl.buckets:
                    kernels.unpack_dequantize(coeffs, *b.starts(self.device), b.qtype, b.size, params,
                                              planes[b.qtype], header.packing)
            return coeffs, pl
        with clock("unpack"):
            params = _from_le(secs[f"{kind}.{g}.params"], torch.float16, (pl.param_rows, n)).to(self.device)
            planes = {}
            for t, c in pl.plane_sizes.items():
                per = packed_plane_bytes(n, TYPE_BITS[t], header.packing)
                packed = _from_le(secs[f"{kind}.{g}.{TYPE_NAMES[t]}"], torch.uint8, (c, per))
                planes[t] = unpack(packed, n, TYPE_BITS[t], header.packing).to(self.device)
        with clock("dequantize"):
            coeffs = torch.zeros((n, pl.components), dtype=torch.float32, device=self.device)
            for b in pl.buckets:
                sym = planes[b.qtype][b.plane_rows.to(self.device)].reshape(-1, b.size, n).permute(2, 0, 1)
                pr = b.param_rows.to(self.device)
                if param_rows(b.qtype) == 2:
                    vals = dequantize(sym, params[pr].T, params[pr + 1].T, b.qtype)
                else:
                    vals = dequantize(sym, None, params[pr].T, b.qtype)
                coeffs[:, b.columns.to(self.device)] = vals
        return coeffs, pl

    def _decode_rows(self, kind: str, header: container.Header, secs: dict[str, bytes], clock: _Clock,
                     out: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The middle tokens' feature rows ``[batch·middle, features]``; with ``out`` (one PCA group: each
        sequence's ``[middle, features]`` view of the output) they are written there and None is returned."""
        n = header.batch * header.middle_tokens
        cols_all = self.calibration.columns  # type: ignore[union-attr]
        rows = None
        if len(cols_all) > 1:
            rows = torch.empty((n, header.layout.num_features), dtype=torch.float32, device=self.device)
        for g in range(len(cols_all)):
            coeffs, pl = self._coefficients(kind, g, header, secs, clock)
            with clock("project"):
                mean, basis = self._basis(kind, g, pl.components, decode=True)
                fp8 = self._fp8_basis(kind, g, pl.components, True) if self._fp8 else None
                x = self._reconstruct(coeffs, mean, basis, fp8, out)
            if rows is None:
                return x
            rows[:, cols_all[g].to(self.device)] = x
        return rows

    def decode_layers(self, blob: bytes, device: torch.device | str | None = None
                      ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(real layer index, keys, values)`` with keys/values ``[B, T, heads, head_dim]`` on ``device``
        (default: CPU), layer by layer: each layer's reconstruction multiplies the coefficients by that
        layer's basis columns only."""
        out_dev = torch.device(device) if device is not None else torch.device("cpu")
        header, secs = self._open(blob, on_device=True)
        lay = header.layout
        B, T = header.batch, header.tokens
        s, w = header.protected
        dt = DTYPES[lay.dtype]
        hd = (len(lay.heads), lay.head_dim)
        prot = {k: _section(secs[f"raw.{k}"], dt, (B, s + w, len(lay.layers), *hd), out_dev) for k in KINDS}
        coeffs: dict[str, list[tuple[torch.Tensor, _PlanLayout]]] = {}
        col_index: list[dict[int, int]] = []
        if header.middle_tokens:
            clock = _Clock(None)
            ngroups = len(self.calibration.columns)  # type: ignore[union-attr]
            coeffs = {k: [self._coefficients(k, g, header, secs, clock) for g in range(ngroups)] for k in KINDS}
            col_index = [{c: i for i, c in enumerate(cols.tolist())} for cols in self.calibration.columns]  # type: ignore[union-attr]
        for li, layer in enumerate(lay.layers):
            out = []
            for kind in KINDS:
                full = torch.empty((B, T, *hd), dtype=dt, device=out_dev)
                full[:, :s] = prot[kind][:, :s, li]
                full[:, T - w :] = prot[kind][:, s:, li]
                if header.middle_tokens:
                    x = torch.empty((B * header.middle_tokens, hd[0] * hd[1]), dtype=torch.float32, device=self.device)
                    lcols = [c for h in lay.heads for c in lay.pair_columns(layer, h)]
                    for g, (c, pl) in enumerate(coeffs[kind]):
                        idx = [(j, col_index[g][col]) for j, col in enumerate(lcols) if col in col_index[g]]
                        if not idx:
                            continue
                        dst = torch.tensor([a for a, _ in idx], device=self.device)
                        src = torch.tensor([b for _, b in idx], device=self.device)
                        mean, basis = self._basis(kind, g, pl.components, decode=True)
                        x[:, dst] = self._reconstruct(c, mean[src], basis[:, src]).to(x.dtype)
                    full[:, s : T - w] = x.to(dt).to(out_dev).reshape(B, header.middle_tokens, *hd)
                out.append(full)
            yield layer, out[0], out[1]

    # ------------------------------------------------------------------ inspect
    @staticmethod
    def inspect(blob: bytes | memoryview | torch.Tensor) -> dict[str, Any]:
        """Header facts and sizes of a blob, without decoding it (needs no calibration)."""
        if isinstance(blob, torch.Tensor):
            if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.device.type != "cpu":
                raise FormatError("a tensor blob must be a 1-D uint8 CPU tensor (e.g. pinned host memory)")
            blob = memoryview(blob.contiguous().numpy())
        header, body = container.read_header(blob)
        lay = header.layout
        esize = torch.empty((), dtype=DTYPES[lay.dtype]).element_size()
        s, w = header.protected
        B, T, N = header.batch, header.tokens, header.middle_tokens
        per_token = 2 * lay.num_features * esize
        raw_secs = [x for x in header.sections if x.name.startswith("raw.")]
        coded = [x for x in header.sections if not x.name.startswith("raw.")]
        overhead = body  # prefix + header
        mid_orig = B * N * per_token
        mid_before = overhead + sum(x.raw for x in coded)
        mid_after = overhead + sum(x.coded for x in coded)
        return {
            "mode": header.mode,
            "calibration": header.calibration,
            "model_id": header.model_id,
            "layout": lay.to_dict(),
            "batch": B,
            "tokens": T,
            "sinks": s,
            "window": w,
            "middle_tokens": N,
            "target_ratio": header.ratio,
            "packing": header.packing,
            "bytes": len(blob),
            "header_bytes": overhead,
            "original_bytes": B * T * per_token,
            "whole_cache_ratio": B * T * per_token / len(blob),
            "codec_ratio_before_entropy": mid_orig / mid_before if N else None,
            "codec_ratio": mid_orig / mid_after if N else None,
            "bytes_per_middle_token": mid_after / (B * N) if N else None,
            "raw_bytes": sum(x.coded for x in raw_secs),
            "sections": [
                {"name": x.name, "backend": x.backend, "raw": x.raw, "coded": x.coded} for x in header.sections
            ],
        }


@contextmanager
def _no_tf32() -> Iterator[None]:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


_FP8_MAX = 448.0
#: fp8 bases are padded to a multiple of this many components (cuBLASLt's fast fp8 kernels want K % 32 == 0)
_FP8_ALIGN = 64
#: a GPU decode writes a sequence's middle tokens straight into the output when it has at least this many
#: (one matmul per sequence; shorter ones take a single matmul and one copy)
DIRECT_MIN_TOKENS = 512


def _device_coder(backend: str, device: torch.device) -> Any:
    """The GPU coder of entropy backend ``backend`` on ``device``, or None (CPU-only backend, no CUDA...)."""
    for mod in (huffman, gpu_entropy):
        if mod.NAME == backend:
            return mod.device_coder(backend, device)
    return None


def _fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, m]`` -> (E4M3 values, float32 per-row scales ``[n, 1]``) for ``torch._scaled_mm`` (the
    division runs in ``x``'s own dtype: no float32 copy of a bf16 input)."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / _FP8_MAX).clamp(min=1e-30).to(x.dtype)
    q = (x / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.float()


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 product with float32 output (fp32 accumulate) where torch offers it, else upcast."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return torch.mm(a, b).float()


class _Clock:
    def __init__(self, sink: dict[str, float] | None):
        self.sink = sink

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if self.sink is None:
            yield
            return
        if self.sink is not None and torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.sink[stage] = self.sink.get(stage, 0.0) + time.perf_counter() - t0


def _le_bytes(t: torch.Tensor) -> bytes:
    """Little-endian bytes of a tensor (the container's byte order on every host)."""
    t = t.detach().contiguous().cpu()
    if t.dtype in (torch.bfloat16,):
        a = t.view(torch.int16).numpy()
    else:
        a = t.numpy()
    return a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def _device_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's bytes as flat uint8 (CUDA devices are little-endian: the container's order)."""
    return t.contiguous().view(torch.uint8).reshape(-1)


def _host_bytes(t: torch.Tensor) -> bytes:
    host = torch.empty(t.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    host.copy_(t.reshape(-1))
    return host.numpy().tobytes()


def _section(data: bytes | torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A decoded section as a tensor on ``device``: host bytes are parsed little-endian, device bytes viewed."""
    if isinstance(data, torch.Tensor):
        count = int(np.prod(shape)) if shape else 1
        esize = torch.empty((), dtype=dtype).element_size()
        if data.numel() != count * esize:
            raise FormatError(f"section holds {data.numel()} bytes, {count * esize} expected")
        return data.view(dtype).reshape(shape).to(device)
    return _from_le(data, dtype, shape).to(device)


def _from_le(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    view_as = {torch.bfloat16: torch.int16}.get(dtype, dtype)
    np_dtype = torch.empty((), dtype=view_as).numpy().dtype.newbyteorder("<")
    count = int(np.prod(shape)) if shape else 1
    if len(data) != count * np_dtype.itemsize:
        raise FormatError(f"section holds {len(data)} bytes, {count * np_dtype.itemsize} expected")
    a = np.frombuffer(data, dtype=np_dtype).astype(np_dtype.newbyteorder("="), copy=True)
    t = torch.from_numpy(a).reshape(shape)
    return t.view(dtype) if view_as is not dtype else t
