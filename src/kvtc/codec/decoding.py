"""The decode half of :class:`~kvtc.codec.Codec`: a blob's header and sections checked against the calibration,
then its middle tokens rebuilt from their coefficients (whole slices, spans of them, or layer by layer).

:class:`Decoding` holds the methods; :class:`~kvtc.codec.Codec` inherits them and sets the state they read
(the calibration, its plan layouts, transform and quantizer, the device and the decode budget).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..calibration.artifact import KINDS
from ..errors import CalibrationMismatch, FormatError
from ..layout import DTYPES, KVSlice
from ..textsafe import printable
from . import budget, container, gpu_decode, ladder, prediction, spans, tiers
from .buffers import section_tensor
from .clock import Clock, stage_clock
from .entropy import device_coder
from .gpu_decode import DIRECT_MIN_TOKENS
from .quantizer import PlanLayout, plan_layouts


class Decoding:
    """Decode methods of :class:`~kvtc.codec.Codec` (see there); the attributes below are the codec's."""

    calibration: Any
    device: torch.device
    precision: str
    max_decoded_bytes: int
    _fused: bool
    _quantizer: Any
    _transform: Any
    _plans: dict[str, list[Any]]

    def _open(
        self, blob: bytes | torch.Tensor, on_device: bool = False, deferred: list[Any] | None = None
    ) -> tuple[container.Header, dict[str, Any]]:
        blob, pinned, header, body = self._checked_header(blob)
        hints: dict[str, Any] = {}
        expected = self._expected_sections(header, hints)
        secs = None
        if on_device and self._fused:
            for name in dict.fromkeys(x.backend for x in header.sections):
                coder = device_coder(name, self.device)
                if coder is not None:
                    secs = container.read_sections(
                        blob, header, body, expected, coder, name, pinned, deferred, hints=hints
                    )
                    break
        if secs is None:
            secs = container.read_sections(blob, header, body, expected, hints=hints)
        secs.pop(container.PAD_SECTION, None)
        if header.tiers:  # each group's mask, checked, in place of its bytes
            middles = spans.group_middles(header, self.calibration.grouping)  # type: ignore[union-attr]
            for g, (_, m) in enumerate(middles):
                if m:
                    name = f"tiers.{g}"
                    secs[name] = tiers.unpack_mask(secs[name], header.batch, m, header.tiers[2], name)
        if header.rungs:  # each group's rung indices, checked against the header's counts; each rung's sections
            assert header.rung_counts is not None
            for kind in KINDS:
                for g, c in enumerate(header.rung_counts[kind]):
                    name = f"rungs.{kind}.{g}"
                    if name not in secs:
                        continue
                    secs[name] = tiers.unpack_rungs(secs[name], c, name)
                    for suffix, pieces in ladder.pieces(self.calibration, header, kind, g).items():
                        data = secs.pop(f"{kind}.{g}.{suffix}")
                        data = data if isinstance(data, torch.Tensor) else memoryview(data).cast("B")
                        off = 0
                        for piece, size in pieces:
                            secs[piece] = data[off : off + size]
                            off += size
        return header, secs

    def _checked_header(self, blob: bytes | torch.Tensor) -> tuple[Any, Any, container.Header, int]:
        """(the blob as a buffer, the blob as a pinned tensor or None, its header, body offset), after the checks
        every decode makes before reading a section: header, decoding budget, calibration, ratio."""
        pinned = None
        if isinstance(blob, torch.Tensor):  # a blob held in (pinned) host memory as a uint8 tensor
            if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.device.type != "cpu":
                raise FormatError("a tensor blob must be a 1-D uint8 CPU tensor (e.g. pinned host memory)")
            pinned = blob if blob.is_pinned() else None
            blob = memoryview(blob.numpy())
        header, body = container.read_header(blob)
        budget.check_declared(header, self.max_decoded_bytes)
        if header.mode == "kvtc":
            cal = self.calibration
            if cal is None or header.calibration != cal.hash:
                raise CalibrationMismatch(
                    f"blob was encoded with calibration {printable(header.calibration, 16)}, this codec has "
                    f"{'none' if cal is None else cal.fingerprint}; decode with the calibration that encoded it"
                )
            cal.check_layout(header.layout)
            if header.adaptive:
                missing = [r for r in (header.rungs or header.tiers[:2]) if r not in cal.plans]  # type: ignore[index]
                if missing:
                    raise FormatError(f"blob names tier ratios {missing}, which its calibration has no plan for")
            elif header.ratio is None or header.ratio not in cal.plans:
                raise FormatError(f"blob names ratio {header.ratio!r}, which its calibration has no plan for")
        # what the blob may cost, from the sizes these checked facts imply and the blob's own bytes
        budget.check_allowance(header, self._expected_sections(header))
        return blob, pinned, header, body

    def _expected_sections(self, h: container.Header, hints: dict[str, Any] | None = None) -> dict[str, int]:
        """Each section's exact raw size, from the header and the calibration; ``hints`` receives each fixed-step
        plane's ``gauss`` model (:class:`kvtc.codec.gaussian.Hint`)."""
        exp = {"positions": 8 * h.batch * h.tokens}
        if h.predicted:
            exp[prediction.SECTION] = 4 * h.batch * h.tokens
        for kind in KINDS:
            exp[f"raw.{kind}"] = spans.raw_bytes(h)
        hints = {} if hints is None else hints

        def add(prefix: str, pl: PlanLayout, n: int) -> None:
            exp.update(pl.section_sizes(prefix, n, h.packing))
            hints.update({f"{prefix}.{t}": hint for t, hint in pl.hints(n, h.packing).items()})

        if h.mode == "kvtc" and h.middle_tokens:
            middles = spans.group_middles(h, self.calibration.grouping)  # type: ignore[union-attr]
            if h.rungs:
                return ladder.expected(self.calibration, h, middles, exp, hints)
            if h.tiers:
                hi, lo = self._tier_layouts(h.tiers)
                for g, (_, m) in enumerate(middles):
                    if m:
                        exp[f"tiers.{g}"] = tiers.mask_bytes(h.batch, m)
                for kind in KINDS:
                    for g, (_, m) in enumerate(middles):
                        k = tiers.high_count(m, h.tiers[2])
                        for prefix, pl, n in ((f"{kind}.{g}", hi[kind][g], k), (f"{kind}.{g}.lo", lo[kind][g], m - k)):
                            if m and n:
                                add(prefix, pl, h.batch * n)
                return exp
            plans = plan_layouts(self.calibration, h.ratio)
            for kind in KINDS:
                for g, pl in enumerate(plans[kind]):
                    if middles[g][1]:
                        add(f"{kind}.{g}", pl, h.batch * middles[g][1])
        return exp

    def _predicted(self, blob: Any) -> tuple[container.Header, torch.Tensor] | None:
        """A version-5 blob's header and token ids (None for any other blob), after the checks every decode makes."""
        view, _, header, body = self._checked_header(blob)
        if not header.predicted:
            return None
        if not self.needs_token_ids:  # type: ignore[attr-defined]
            raise FormatError("a blob with token ids whose calibration has no token map; the blob is corrupt")
        return header, prediction.read_ids(view, header, body)

    def decode(
        self,
        blob: bytes | torch.Tensor,
        timings: dict[str, float] | None = None,
        device: torch.device | str | None = None,
    ) -> KVSlice:
        """Reconstruct the slice a blob holds (keys pre-RoPE, in the layout's dtype), on ``device``
        (default: CPU). ``blob``: bytes, or a 1-D uint8 CPU tensor holding them (pinned host memory lets a GPU
        codec copy the coded streams to the device without staging)."""
        predicted = self._predicted(blob)
        if predicted is not None:
            token_map, emb = self._token_map()  # type: ignore[attr-defined]
        kv = self._decode(blob, timings, device)
        if predicted is None:
            return kv
        clock = stage_clock(timings)
        with clock("predict"):
            return prediction.shift(kv, predicted[0], token_map, emb, predicted[1], 1.0)

    def _decode(
        self,
        blob: bytes | torch.Tensor,
        timings: dict[str, float] | None = None,
        device: torch.device | str | None = None,
    ) -> KVSlice:
        out_dev = torch.device(device) if device is not None else torch.device("cpu")
        if self._fused and out_dev == self.device:
            fast = gpu_decode.decode(self, blob, timings)
            if fast is not None:
                return fast
        clock = stage_clock(timings)
        checks: list[Any] = []  # checksums still running on host threads (GPU path): verified before returning
        with clock("parse"):
            header, secs = self._open(blob, on_device=True, deferred=checks)
        lay = header.layout
        B, T = header.batch, header.tokens
        s, w = header.protected
        dt = DTYPES[lay.dtype]
        shape = (B, T, len(lay.layers), len(lay.heads), lay.head_dim)
        positions = section_tensor(secs["positions"], torch.int64, (B, T), out_dev)
        out = {}
        if len(header.spans) > 1 or header.spans[0][1] > 0:  # some layers hold only their newest tokens
            for kind in KINDS:
                out[kind] = self._decode_spans(kind, header, secs, clock, out_dev)
            kinds: tuple[str, ...] = ()
        else:
            kinds = KINDS
        for kind in kinds:
            prot = section_tensor(secs[f"raw.{kind}"], dt, (B, s + w, *shape[2:]), out_dev)
            full = torch.empty(shape, dtype=dt, device=out_dev)
            full[:, :s] = prot[:, :s]
            full[:, T - w :] = prot[:, s:]
            if header.middle_tokens:
                m = header.middle_tokens
                # the projection writes each sequence's middle tokens straight into the output where it can
                # (one PCA group, output on the codec's device in the projection's dtype): no extra pass
                direct = (
                    self._fused
                    and out_dev == self.device
                    and len(self.calibration.columns) == 1  # type: ignore[union-attr]
                    and dt == self._transform.out_dtype
                    and (s + w == 0 or m >= DIRECT_MIN_TOKENS)
                    and not header.adaptive
                )
                views = None
                if direct:  # one view when nothing is protected, else one per sequence
                    views = [full.view(B * m, -1)] if s + w == 0 else [full[b, s : T - w].view(m, -1) for b in range(B)]
                rows = self._decode_rows(kind, header, secs, clock, views)
                if rows is not None:
                    with clock("to_tokens"):
                        full[:, s : T - w] = rows.to(dt).to(out_dev).reshape(B, m, *shape[2:])
            out[kind] = full
        with clock("verify"):
            for check in checks:
                check()
        return KVSlice(lay, out["keys"], out["values"], positions, header.model_id)

    def _decode_spans(
        self, kind: str, header: container.Header, secs: dict[str, Any], clock: Clock, out_dev: torch.device
    ) -> torch.Tensor:
        """``[B, T, L, H, D]`` of one kind when layers hold different tokens: zero where a layer holds none."""
        lay = header.layout
        B, T = header.batch, header.tokens
        dt = DTYPES[lay.dtype]
        full = torch.zeros((B, T, len(lay.layers), len(lay.heads), lay.head_dim), dtype=dt, device=out_dev)
        esize = full.element_size()
        prot = section_tensor(secs[f"raw.{kind}"], dt, (spans.raw_bytes(header) // esize,), out_dev)
        spans.fill_protected(full, spans.raw_blocks(prot, header), header)
        if header.mode != "kvtc" or not header.middle_tokens:
            return full
        cols = self.calibration.columns  # type: ignore[union-attr]
        for g, (start, m) in enumerate(spans.group_middles(header, self.calibration.grouping)):  # type: ignore[union-attr]
            if not m:
                continue
            x = self._group_rows(kind, g, header, secs, clock, B * m)
            with clock("to_tokens"):
                spans.middle_view(full, start, m)[:, :, cols[g].to(out_dev)] = x.to(dt).to(out_dev).view(B, m, -1)
        return full

    def _coefficients(
        self, kind: str, g: int, header: container.Header, secs: dict[str, Any], clock: Clock, n: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """Group ``g``'s coefficients ``[n, columns]`` and the basis components they span."""
        tr = self._transform
        n = header.batch * header.middle_tokens if n is None else n
        if not header.adaptive:
            pl = plan_layouts(self.calibration, header.ratio)[kind][g]
            coeffs = self._quantizer.decode(
                f"{kind}.{g}", secs, pl, n, header.packing, clock, tr.coefficient_dtype,
                tr.coefficient_columns(pl.components),
            )  # type: ignore[union-attr]  # fmt: skip
            return coeffs, pl.components
        parts = self._tier_parts(kind, g, header, secs, clock)
        k = max(c for _, _, c in parts)
        coeffs = None
        for rows, part, _ in parts:
            if coeffs is None:
                coeffs = torch.zeros((n, tr.coefficient_columns(k)), dtype=part.dtype, device=part.device)
            coeffs[rows.to(part.device), : part.shape[1]] = part
        assert coeffs is not None
        return coeffs, k

    def _tier_parts(
        self, kind: str, g: int, header: container.Header, secs: dict[str, Any], clock: Clock
    ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """A tiered or rate-ladder blob's group ``g``: ``(row mask, coefficients, components)`` of each tier or rung
        that codes a token."""
        tr = self._transform
        if header.rungs:
            assert header.rung_counts is not None
            idx = secs[f"rungs.{kind}.{g}"].to(self.device)
            parts = []
            for j, r in enumerate(header.rungs):
                count = header.rung_counts[kind][g][j]
                if count:
                    pl = plan_layouts(self.calibration, r)[kind][g]
                    part = self._quantizer.decode(
                        f"{kind}.{g}.r{j}", secs, pl, count, header.packing, clock, tr.coefficient_dtype,
                        tr.coefficient_columns(pl.components),
                    )  # type: ignore[union-attr]  # fmt: skip
                    parts.append((idx == j, part, pl.components))
            return parts
        assert header.tiers is not None
        hi, lo = self._tier_layouts(header.tiers)
        mask = secs[f"tiers.{g}"].to(self.device)
        out = []
        for prefix, pl, rows in ((f"{kind}.{g}", hi[kind][g], mask), (f"{kind}.{g}.lo", lo[kind][g], ~mask)):
            count = int(rows.sum())
            if count:
                part = self._quantizer.decode(
                    prefix, secs, pl, count, header.packing, clock, tr.coefficient_dtype,
                    tr.coefficient_columns(pl.components),
                )  # type: ignore[union-attr]  # fmt: skip
                out.append((rows, part, pl.components))
        return out

    def _group_rows(
        self,
        kind: str,
        g: int,
        header: container.Header,
        secs: dict[str, Any],
        clock: Clock,
        n: int,
        out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Group ``g``'s reconstructed feature rows ``[n, p_g]`` (``out``: see :meth:`PCATransform.reconstruct`;
        not for a tiered blob, whose tiers are each reconstructed with their own components, then placed)."""
        tr = self._transform
        if not header.adaptive:
            coeffs, k = self._coefficients(kind, g, header, secs, clock, n)
            with clock("project"):
                return tr.reconstruct(kind, g, coeffs, k, out)  # type: ignore[union-attr]
        assert out is None
        x = None
        for rows, part, k in self._tier_parts(kind, g, header, secs, clock):
            with clock("project"):
                y = tr.reconstruct(kind, g, part, k, None)  # type: ignore[union-attr]
            if x is None:
                x = torch.empty((n, y.shape[1]), dtype=y.dtype, device=y.device)
            x[rows.to(y.device)] = y
        return x

    def _decode_rows(
        self,
        kind: str,
        header: container.Header,
        secs: dict[str, Any],
        clock: Clock,
        out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """The middle tokens' feature rows ``[batch·middle, features]``; with ``out`` (one PCA group: each
        sequence's ``[middle, features]`` view of the output) they are written there and None is returned."""
        n = header.batch * header.middle_tokens
        cols_all = self.calibration.columns  # type: ignore[union-attr]
        rows = None
        if len(cols_all) > 1:
            rows = torch.empty((n, header.layout.num_features), dtype=torch.float32, device=self.device)
        for g in range(len(cols_all)):
            x = self._group_rows(kind, g, header, secs, clock, header.batch * header.middle_tokens, out)
            if rows is None:
                return x
            rows[:, cols_all[g].to(self.device)] = x
        return rows

    def decode_layers(
        self, blob: bytes, device: torch.device | str | None = None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(real layer index, keys, values)`` with keys/values ``[B, T, heads, head_dim]`` on ``device``
        (default: CPU), layer by layer: each layer's reconstruction multiplies the coefficients by that
        layer's basis columns only (the GPU path: views of :meth:`decode`'s output, handed over while its products
        run). A sliding-window layer's tokens older than those it holds are zero."""
        predicted = self._predicted(blob)
        if predicted is None:
            yield from self._decode_layers(blob, device)
            return
        token_map, emb = self._token_map()  # type: ignore[attr-defined]
        yield from prediction.add_to_layers(
            self._decode_layers(blob, device), predicted[0], token_map, emb, predicted[1]
        )

    def _decode_layers(
        self, blob: bytes, device: torch.device | str | None = None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        out_dev = torch.device(device) if device is not None else torch.device("cpu")
        if self._fused and out_dev == self.device:
            fast = gpu_decode.decode_layers(self, blob)
            if fast is not None:
                yield from fast
                return
        header, secs = self._open(blob, on_device=True)
        lay = header.layout
        B, T = header.batch, header.tokens
        dt = DTYPES[lay.dtype]
        hd = (len(lay.heads), lay.head_dim)
        esize = torch.empty((), dtype=dt).element_size()
        flat = {k: section_tensor(secs[f"raw.{k}"], dt, (spans.raw_bytes(header) // esize,), out_dev) for k in KINDS}
        blocks = {k: spans.raw_blocks(flat[k], header) for k in KINDS}
        span_index = {sp: i for i, (sp, *_) in enumerate(header.spans)}
        coeffs: dict[str, list[tuple[torch.Tensor, int] | None]] = {}
        col_index: list[dict[int, int]] = []
        if header.mode == "kvtc" and header.middle_tokens:
            clock = stage_clock(None)
            middles = spans.group_middles(header, self.calibration.grouping)  # type: ignore[union-attr]
            coeffs = {
                k: [
                    self._coefficients(k, g, header, secs, clock, B * m) if m else None
                    for g, (_, m) in enumerate(middles)
                ]
                for k in KINDS
            }
            col_index = [{c: i for i, c in enumerate(cols.tolist())} for cols in self.calibration.columns]  # type: ignore[union-attr]
        for li, (sp, j, first, s, w, m) in enumerate(spans.per_layer(header)):
            layer = lay.layers[li]
            out = []
            for kind in KINDS:
                prot = blocks[kind][span_index[sp]]
                full = (torch.zeros if first else torch.empty)((B, T, *hd), dtype=dt, device=out_dev)
                full[:, first : first + s] = prot[:, :s, j]
                full[:, T - w :] = prot[:, s:, j]
                if m and coeffs:
                    x = torch.empty((B * m, hd[0] * hd[1]), dtype=torch.float32, device=self.device)
                    lcols = [c for h in lay.heads for c in lay.pair_columns(layer, h)]
                    for g, entry in enumerate(coeffs[kind]):
                        idx = [(a, col_index[g][col]) for a, col in enumerate(lcols) if col in col_index[g]]
                        if not idx or entry is None:
                            continue
                        c, k = entry
                        dst = torch.tensor([a for a, _ in idx], device=self.device)
                        src = torch.tensor([b for _, b in idx], device=self.device)
                        x[:, dst] = self._transform.reconstruct_columns(kind, g, c, k, src).to(x.dtype)  # type: ignore[union-attr]
                    full[:, first + s : T - w] = x.to(dt).to(out_dev).reshape(B, m, *hd)
                out.append(full)
            yield layer, out[0], out[1]
