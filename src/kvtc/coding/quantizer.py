"""The quantizer stage of the codec: PCA coefficients <-> one PCA group's coded sections, by its bit plan.

A group's sections (docs/FORMAT.md): ``{prefix}.params`` (fp16 ``[R, N]``: each kept group's per-token range
parameters in plan order, a row of N tokens each: shift then scale, or the scale alone for a scale-only type) and
``{prefix}.{type}`` (packed planes, component order) for each type the plan uses, in :data:`CODED_TYPES` order.

:class:`Quantizer` runs the fused Triton kernels (:mod:`kvtc.kernels`) on a CUDA device and the torch reference
(:mod:`kvtc.quant`, :mod:`kvtc.coding.packing`) everywhere else; both write the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from .. import kernels
from ..quant import (
    CODED_TYPES,
    DROP,
    FIXED_TYPES,
    TYPE_BITS,
    TYPE_NAMES,
    dequantize,
    dequantize_numpy,
    param_rows,
    quantize,
)
from . import gaussian
from .buffers import Scratch, host_view, le_bytes, section_tensor
from .clock import Clock
from .entropy import Modeled
from .packing import pack, packed_plane_bytes, symbols_per_byte


@dataclass
class Bucket:
    """Kept groups of one (type, size): where their components go in the plane and in the params."""

    qtype: int
    size: int
    columns: torch.Tensor  # [n, size] component indices
    plane_rows: torch.Tensor  # [n * size] rows of the type's plane, component-major
    param_rows: torch.Tensor  # [n] first row of each group in the params stream (its shift, or its scale)
    clips: torch.Tensor | None = None  # [n] float32 encoder clips or fixed steps (None: all 1)

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
            cache[key] = tuple(
                t.to(device, torch.int32).contiguous()
                for t in (self.columns[:, 0], self.plane_rows.view(-1, self.size)[:, 0], self.param_rows)
            )
        return cache[key]


@dataclass
class PlanLayout:
    """Where a plan's kept groups go: the params rows and each type's plane rows."""

    plan: Any  # the :class:`~kvtc.calibration.plan.Plan` laid out (not imported: the calibration sits above)
    components: int  # basis rows the plan uses
    kept_groups: int
    param_rows: int  # rows of the params stream
    plane_sizes: dict[int, int]  # type -> components in its plane
    buckets: list[Bucket]
    #: fixed-step type -> int16 ``[plane rows]``: each row's standard deviation in steps on the ``gauss`` grid
    #: (:func:`kvtc.coding.gaussian.std_index`; set by :func:`plan_layouts` from the calibration's eigenvalues)
    spreads: dict[int, Any] | None = None

    def set_spreads(self, eigenvalues: torch.Tensor) -> None:
        """Each fixed-step plane row's model index: ``√λ / Δ`` of its component (eigenvalue ``λ``, step ``Δ``)."""
        out = {}
        ev = eigenvalues.double().cpu().clamp_min(0)
        for t, rows in self.plane_sizes.items():
            if t not in FIXED_TYPES:
                continue
            std = torch.zeros(rows, dtype=torch.float64)
            for b in self.buckets:
                if b.qtype == t:
                    step = torch.ones(b.columns.numel(), dtype=torch.float64) if b.clips is None else (
                        b.clips.double().repeat_interleave(b.size)
                    )  # fmt: skip
                    std[b.plane_rows] = ev[b.columns.reshape(-1)].sqrt() / step
            out[t] = gaussian.std_index(std)
        self.spreads = out

    def hints(self, tokens: int, packing: str) -> dict[str, gaussian.Hint]:
        """Type name -> the ``gauss`` model of its plane for ``tokens`` coded tokens (fixed-step types)."""
        if self.spreads is None or not tokens:
            return {}
        return {TYPE_NAMES[t]: gaussian.Hint(TYPE_BITS[t], packing, ((tokens, ks),)) for t, ks in self.spreads.items()}

    @classmethod
    def build(cls, plan: Any) -> PlanLayout:
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
                Bucket(
                    t,
                    size,
                    starts[:, None] + offs,
                    (rows0[:, None] + offs).reshape(-1),
                    torch.tensor([param_row_of[g] for g in gis], dtype=torch.int64),
                    cl if bool((cl != 1.0).any()) else None,
                )
            )
        return cls(plan, plan.kept_components, len(kept), prows, {t: n for t, n in plane_sizes.items() if n}, buckets)

    def section_sizes(self, prefix: str, tokens: int, packing: str) -> dict[str, int]:
        """Raw bytes of each of the group's sections for ``tokens`` coded tokens, in blob order."""
        sizes = {f"{prefix}.params": self.param_rows * tokens * 2}
        for t in CODED_TYPES:
            if t in self.plane_sizes:
                sizes[f"{prefix}.{TYPE_NAMES[t]}"] = self.plane_sizes[t] * packed_plane_bytes(
                    tokens, TYPE_BITS[t], packing
                )
        return sizes


class Quantizer:
    """Coefficients ``[tokens, components]`` <-> a PCA group's sections; fused GPU kernels when ``fused``."""

    def __init__(self, device: torch.device, fused: bool):
        self.device = device
        self.fused = fused

    def encode(
        self, prefix: str, coeffs: torch.Tensor, pl: PlanLayout, packing: str, clock: Clock
    ) -> list[tuple[str, Any]]:
        """The group's sections: device tensors (fused path: the GPU entropy coder or a copy takes them to the
        host) or little-endian host bytes."""
        n, dev = coeffs.shape[0], coeffs.device
        if self.fused:
            with clock("quantize"):
                params = torch.empty((pl.param_rows, n), dtype=torch.float16, device=dev)
                planes = {
                    t: torch.empty((c, packed_plane_bytes(n, TYPE_BITS[t], packing)), dtype=torch.uint8, device=dev)
                    for t, c in pl.plane_sizes.items()
                }
                for b in pl.buckets:
                    kernels.quantize_pack(
                        coeffs, *b.starts(dev), b.qtype, b.size, params, planes[b.qtype], packing, b.device_clips(dev)
                    )
            out: list[tuple[str, Any]] = [(f"{prefix}.params", params.view(torch.uint8).reshape(-1))]
            out.extend((f"{prefix}.{TYPE_NAMES[t]}", planes[t].reshape(-1)) for t in CODED_TYPES if t in planes)
            return out
        with clock("quantize"):
            params = torch.empty((pl.param_rows, n), dtype=torch.float16, device=dev)
            planes = {t: torch.empty((c, n), dtype=torch.uint8, device=dev) for t, c in pl.plane_sizes.items()}
            for b in pl.buckets:
                x = coeffs[:, b.columns.to(dev)]  # [n, groups, size]
                sym, shift, scale = quantize(x, b.qtype, 1.0 if b.clips is None else b.clips)
                pr = b.param_rows.to(dev)
                if param_rows(b.qtype) == 2:
                    params[pr] = shift.T
                    params[pr + 1] = scale.T
                elif param_rows(b.qtype) == 1:
                    params[pr] = scale.T
                planes[b.qtype][b.plane_rows.to(dev)] = sym.permute(1, 2, 0).reshape(-1, n)
        with clock("pack"):
            out = [(f"{prefix}.params", le_bytes(params))]
            hints = pl.hints(n, packing)
            for t in CODED_TYPES:
                if t in planes:
                    data = le_bytes(pack(planes[t].cpu(), TYPE_BITS[t], packing))
                    hint = hints.get(TYPE_NAMES[t])
                    out.append((f"{prefix}.{TYPE_NAMES[t]}", data if hint is None else Modeled(data, hint)))
        return out

    @staticmethod
    def dequantized(coeffs: torch.Tensor, pl: PlanLayout) -> torch.Tensor:
        """float32 ``[n, pl.components]``: ``coeffs`` (at least the plan's components) as a decoder of ``pl`` would
        give them back (dropped components zero, range parameters in fp16 as stored). The reference quantizer on
        any device: what a rate-ladder encode weighs its rungs by."""
        x_all = coeffs.float()
        out = torch.zeros((x_all.shape[0], pl.components), dtype=torch.float32, device=x_all.device)
        for b in pl.buckets:
            cols = b.columns.to(x_all.device)
            clip = 1.0 if b.clips is None else b.clips.to(x_all.device)
            sym, shift, scale = quantize(x_all[:, cols], b.qtype, clip)
            if param_rows(b.qtype) == 0:
                out[:, cols] = dequantize(sym, None, None, b.qtype, clip)
            else:
                out[:, cols] = dequantize(sym, shift, scale, b.qtype)
        return out

    def decode(
        self,
        prefix: str,
        secs: dict[str, Any],
        pl: PlanLayout,
        n: int,
        packing: str,
        clock: Clock,
        dtype: torch.dtype = torch.float32,
        columns: int | None = None,
        col_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The group's coefficients ``[n, columns]`` (``columns``: at least the plan's components; the extra ones
        stay zero) from its sections; ``dtype``: of the fused path's coefficients (the reference's are float32).
        ``col_scale`` (fused path): float32 ``[columns]`` factors applied to each column, saturated to ±448 (an
        fp8 ``dtype``: the operand of an fp8 reconstruction)."""
        if self.fused:
            with clock("dequantize"):
                coeffs = torch.zeros((n, columns or pl.components), dtype=dtype, device=self.device)
                self.dequantize(prefix, secs, pl, coeffs, packing, col_scale)
            return coeffs
        return self.rows(prefix, secs, pl, n, packing, clock)(0, n)

    def rows(
        self,
        prefix: str,
        secs: dict[str, Any],
        pl: PlanLayout,
        n: int,
        packing: str,
        clock: Clock,
        dtype: torch.dtype = torch.float32,
        columns: int | None = None,
        most: int = 0,
        work: Scratch | None = None,
    ) -> Callable[[int, int], torch.Tensor]:
        """``coeffs(r0, r1)``: rows ``[r0, r1)`` of :meth:`decode`'s coefficients, the same values, decoded from
        the group's sections where they lie. The reference path reads only those rows' symbols and parameters, into
        the buffers of ``work`` (``most``: the most rows a call will ask for): a decoder's memory then grows with the
        rows it asks for at once, not with ``n``, and a call's result lasts until the next call of any source that
        shares ``work``. The fused path decodes them all once."""
        if self.fused:
            coeffs = self.decode(prefix, secs, pl, n, packing, clock, dtype, columns)
            return lambda r0, r1: coeffs[r0:r1]
        dev = self.device
        params = host_view(secs[f"{prefix}.params"], torch.float16, (pl.param_rows, n)).numpy()
        packed = {
            t: host_view(
                secs[f"{prefix}.{TYPE_NAMES[t]}"], torch.uint8, (c, packed_plane_bytes(n, TYPE_BITS[t], packing))
            ).numpy()
            for t, c in pl.plane_sizes.items()
        }
        index = [
            (
                b,
                b.plane_rows.numpy(),
                b.param_rows.numpy(),
                b.columns.numpy(),
                None if b.clips is None else b.clips.numpy(),
            )
            for b in pl.buckets
        ]
        work = Scratch() if work is None else work
        most = min(max(most, 1), n)
        widest = max((b.columns.numel() for b in pl.buckets), default=0)

        def coeffs(r0: int, r1: int) -> torch.Tensor:
            r = r1 - r0
            with clock("unpack"):
                par = params[:, r0:r1]
                planes = {
                    t: _unpack_rows(p, r0, r1, TYPE_BITS[t], packing, work, f"plane{t}", most)
                    for t, p in packed.items()
                }
            with clock("dequantize"):  # numpy: each operation on this thread (see quant.dequantize_numpy)
                out = work.numpy("coeffs", (r, pl.components), np.float32, most * pl.components)
                out.fill(0)
                for b, plane_rows, pr, cols, steps in index:
                    sym = work.numpy("sym", (len(plane_rows), r), np.uint8, most * widest)
                    np.take(planes[b.qtype], plane_rows, axis=0, out=sym)
                    sym = sym.reshape(-1, b.size, r).transpose(2, 0, 1)
                    vals = work.numpy("vals", sym.shape, np.float32, most * widest)
                    if param_rows(b.qtype) == 0:
                        dequantize_numpy(sym, None, None, b.qtype, steps, vals)
                    else:
                        scale = work.numpy("scale", (len(pr), r), np.float16, most * widest)
                        np.take(par, pr + param_rows(b.qtype) - 1, axis=0, out=scale)
                        shift = None
                        if param_rows(b.qtype) == 2:
                            shift = np.take(
                                par, pr, axis=0, out=work.numpy("shift", scale.shape, np.float16, most * widest)
                            )
                            shift = shift.T
                        dequantize_numpy(sym, shift, scale.T, b.qtype, out=vals)
                    out[:, cols] = vals
                return torch.from_numpy(out).to(dev)

        return coeffs

    def dequantize(
        self,
        prefix: str,
        secs: dict[str, Any],
        pl: PlanLayout,
        coeffs: torch.Tensor,
        packing: str,
        col_scale: torch.Tensor | None = None,
    ) -> None:
        """Fused path: write the group's dequantized components into ``coeffs`` ``[n, columns]`` (see
        :meth:`decode`)."""
        n = coeffs.shape[0]
        params = section_tensor(secs[f"{prefix}.params"], torch.float16, (pl.param_rows, n), self.device)
        planes = {
            t: section_tensor(
                secs[f"{prefix}.{TYPE_NAMES[t]}"],
                torch.uint8,
                (c, packed_plane_bytes(n, TYPE_BITS[t], packing)),
                self.device,
            )
            for t, c in pl.plane_sizes.items()
        }
        for b in pl.buckets:
            kernels.unpack_dequantize(
                coeffs, *b.starts(self.device), b.qtype, b.size, params, planes[b.qtype], packing, col_scale,
                b.device_clips(self.device),
            )  # fmt: skip


def _unpack_rows(
    packed: np.ndarray, r0: int, r1: int, bits: int, packing: str, work: Scratch, name: str, most: int
) -> np.ndarray:
    """Symbols ``[r0, r1)`` of each plane of ``packed`` (uint8 ``[planes, packed bytes]``) as uint8
    ``[planes, r1 - r0]``: :func:`kvtc.coding.packing.unpack` of the bytes that hold them, by a table of each byte's
    symbols (no int32 copies of the planes), into ``work``'s buffer ``name`` (reserved for ``most`` rows)."""
    per = symbols_per_byte(bits, packing)
    if per == 1:
        return packed[:, r0:r1]
    b0, b1 = r0 // per, -(-r1 // per)
    table = _byte_symbols(bits, per)
    words = work.numpy(name, (packed.shape[0], b1 - b0), table.dtype, packed.shape[0] * (most // per + 2))
    np.take(table, packed[:, b0:b1], out=words)
    return words.view(np.uint8).reshape(packed.shape[0], -1)[:, r0 - b0 * per : r1 - b0 * per]


@cache
def _byte_symbols(bits: int, per: int) -> np.ndarray:
    """``[256]`` words of ``per`` bytes: byte value -> its ``per`` symbols of ``bits`` bits (low bits first), one a
    byte, in memory order."""
    table = (np.arange(256)[:, None] >> (np.arange(per) * bits)) & ((1 << bits) - 1)
    return np.ascontiguousarray(table.astype(np.uint8)).view(f"<u{per}").reshape(256)


def plan_layouts(calibration: Any, ratio: float) -> dict[str, list[PlanLayout]]:
    """Each kind's :class:`PlanLayout` per PCA group at ``ratio``, built once per calibration and ratio (a
    calibration's plans do not change)."""
    plans = calibration.plans[ratio]
    key = (ratio, tuple(id(p) for ps in plans.values() for p in ps))  # the layouts keep their plans alive
    cache = calibration.__dict__.setdefault("_plan_layouts", {})
    if key not in cache:
        cache[key] = {kind: [PlanLayout.build(p) for p in ps] for kind, ps in plans.items()}
        for kind, pls in cache[key].items():
            for g, pl in enumerate(pls):
                pl.set_spreads(calibration.pcas[kind][g].eigenvalues)
    return cache[key]


__all__ = ["CODED_TYPES", "Bucket", "PlanLayout", "Quantizer", "plan_layouts"]
