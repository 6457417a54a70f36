"""The decode half of :class:`~kvtc.codec.Codec`: a blob's header and sections checked against the calibration,
then its middle tokens rebuilt from their coefficients (whole slices, spans of them, or layer by layer).

:class:`Decoding` holds the methods; :class:`~kvtc.codec.Codec` inherits them and sets the state they read
(the calibration, its plan layouts, transform and quantizer, the device and the decode budget).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..calibration.artifact import KINDS
from ..coding.buffers import MIN_CHUNK_ROWS, Scratch, chunk_bytes, chunk_rows, row_chunks, section_tensor, section_view
from ..coding.clock import Clock, stage_clock
from ..coding.entropy import device_coder
from ..coding.quantizer import PlanLayout, plan_layouts
from ..errors import CalibrationMismatch, FormatError
from ..layout import DTYPES, KVSlice
from ..textsafe import printable
from . import budget, container, gpu_decode, ladder, prediction, spans, tiers
from .gpu_decode import DIRECT_MIN_TOKENS


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
        plane's ``gauss`` model (:class:`kvtc.coding.gaussian.Hint`)."""
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
        codec copy the coded streams to the device without staging).

        Memory: besides the result, a CPU decode holds the blob's decoded sections (dropping each kind's once its
        tokens are written) and a few times :data:`~kvtc.coding.buffers.CHUNK_BYTES` of intermediates: the middle
        tokens are reconstructed in chunks of rows, straight into the result."""
        predicted = self._predicted(blob)
        if predicted is not None:
            token_map, emb = self._token_map()  # type: ignore[attr-defined]
        kv = self._decode(blob, timings, device)
        if predicted is None:
            return kv
        clock = stage_clock(timings)
        with clock("predict"):  # into the tensors this decode made
            return prediction.shift(kv, predicted[0], token_map, emb, predicted[1], 1.0, inplace=True)

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
        positions = section_tensor(secs.pop("positions"), torch.int64, (header.batch, header.tokens), out_dev)
        # one kind after the other, each kind's sections dropped once its tokens are written
        out = {kind: self._decode_kind(kind, header, secs, clock, out_dev) for kind in KINDS}
        with clock("verify"):
            for check in checks:
                check()
        return KVSlice(header.layout, out["keys"], out["values"], positions, header.model_id)

    def _decode_kind(
        self, kind: str, header: container.Header, secs: dict[str, Any], clock: Clock, out_dev: torch.device
    ) -> torch.Tensor:
        """``[B, T, L, H, D]`` of one kind, zero where a layer holds no token; its sections are dropped from
        ``secs`` once read."""
        lay = header.layout
        B, T = header.batch, header.tokens
        s, w = header.protected
        dt = DTYPES[lay.dtype]
        dense = len(header.spans) == 1 and header.spans[0][1] == 0  # every layer holds every token
        shape = (B, T, len(lay.layers), len(lay.heads), lay.head_dim)
        full = (torch.empty if dense else torch.zeros)(shape, dtype=dt, device=out_dev)
        prot = section_view(secs.pop(f"raw.{kind}"), dt, (spans.raw_bytes(header) // full.element_size(),), out_dev)
        spans.fill_protected(full, spans.raw_blocks(prot, header), header)
        del prot
        if header.mode == "kvtc" and header.middle_tokens:
            m = header.middle_tokens
            tr = self._transform
            # the projection writes each sequence's middle tokens straight into the output where it can
            # (one PCA group, output on the codec's device in the projection's dtype): no extra pass
            direct = (
                dense
                and self._fused
                and out_dev == self.device
                and len(self.calibration.columns) == 1  # type: ignore[union-attr]
                and dt == tr.out_dtype
                and (s + w == 0 or m >= DIRECT_MIN_TOKENS)
                and not header.adaptive
            )
            if direct:  # one view when nothing is protected, else one per sequence
                views = [full.view(B * m, -1)] if s + w == 0 else [full[b, s : T - w].view(m, -1) for b in range(B)]
                _, coeffs, k, _ = self._parts(kind, 0, header, secs, clock, B * m)[0]
                with clock("project"):
                    tr.reconstruct(kind, 0, coeffs(0, B * m), k, views)
            else:
                self._fill_middle(kind, header, secs, clock, full)
        _drop(secs, kind)
        return full

    def _fill_middle(
        self, kind: str, header: container.Header, secs: dict[str, Any], clock: Clock, full: torch.Tensor
    ) -> None:
        """Reconstruct each PCA group's middle rows of ``kind`` into ``full [B, T, L, H, D]``, a chunk of rows at a
        time (:func:`~kvtc.coding.buffers.chunk_rows`: about :data:`~kvtc.coding.buffers.CHUNK_BYTES` of float32;
        the fused GPU path multiplies each plan's rows at once and writes them out in such chunks). Each product
        spans at least :data:`~kvtc.coding.buffers.MIN_CHUNK_ROWS` rows: every row gets the bits one product gives
        it."""
        B = header.batch
        F = header.layout.num_features
        tr = self._transform
        chunk = chunk_bytes(budget.decoded_output_bytes(header))
        cols_all = self.calibration.columns  # type: ignore[union-attr]
        work = Scratch()
        for g, (start, m) in enumerate(spans.group_middles(header, self.calibration.grouping)):  # type: ignore[union-attr]
            if not m:
                continue
            mv = spans.middle_view(full, start, m)
            p = len(cols_all[g])
            ystep = chunk_rows(4 * p, chunk)  # rows reconstructed at once
            most = min(ystep + MIN_CHUNK_ROWS, B * m) * p  # elements of the buffers to reserve
            cols = _subset(cols_all[g], F, full.device)
            for rows, coeffs, k, count in self._parts(kind, g, header, secs, clock, B * m, chunk, work):
                at = None if rows is None else rows.nonzero().squeeze(1)
                # rows decoded at once (the fused path decodes them all)
                cstep = count if self._fused else chunk_rows(4 * tr.coefficient_columns(k), chunk)
                for r0, r1 in row_chunks(count, cstep):
                    c = coeffs(r0, r1)
                    for a, b in row_chunks(r1 - r0, r1 - r0 if self._fused else ystep):
                        with clock("project"):
                            if self._fused:
                                y = tr.reconstruct(kind, g, c[a:b], k)  # type: ignore[union-attr]
                            else:  # into a buffer the chunks share
                                y = work.tensor("y", (b - a, p), tr.out_dtype, self.device, most)
                                tr.reconstruct(kind, g, c[a:b], k, [y])  # type: ignore[union-attr]
                        with clock("to_tokens"):
                            for w0, w1 in row_chunks(b - a, ystep):
                                r = r0 + a + w0
                                _put_rows(mv, r if at is None else at[r : r + w1 - w0], y[w0:w1], cols, work, most)
                        del y
                    del c

    def _parts(
        self,
        kind: str,
        g: int,
        header: container.Header,
        secs: dict[str, Any],
        clock: Clock,
        n: int,
        chunk: int | None = None,
        work: Scratch | None = None,
    ) -> list[tuple[torch.Tensor | None, Callable[[int, int], torch.Tensor], int, int]]:
        """Group ``g``'s ``n`` coded rows as ``(rows, coefficients, components, count)`` per plan that codes any:
        ``rows`` None for one plan (every row, in order), else the bool mask ``[n]`` of the rows a tier or rung
        codes (its rows in token order); ``coefficients(r0, r1)``: rows ``[r0, r1)`` of its ``count``
        (:meth:`~kvtc.coding.quantizer.Quantizer.rows`; ``chunk``: the bytes of coefficients asked for at once;
        ``work``: the buffers the parts share, so a part's coefficients last until any part is asked again)."""
        tr, q = self._transform, self._quantizer

        def source(prefix: str, pl: PlanLayout, count: int) -> Callable[[int, int], torch.Tensor]:
            cc = tr.coefficient_columns(pl.components)
            most = chunk_rows(4 * cc, chunk) + MIN_CHUNK_ROWS
            return q.rows(prefix, secs, pl, count, header.packing, clock, tr.coefficient_dtype, cc, most, work)

        if not header.adaptive:
            pl = plan_layouts(self.calibration, header.ratio)[kind][g]
            return [(None, source(f"{kind}.{g}", pl, n), pl.components, n)]
        out = []
        if header.rungs:
            assert header.rung_counts is not None
            idx = secs[f"rungs.{kind}.{g}"].to(self.device)
            for j, r in enumerate(header.rungs):
                count = header.rung_counts[kind][g][j]
                if count:
                    pl = plan_layouts(self.calibration, r)[kind][g]
                    out.append((idx == j, source(f"{kind}.{g}.r{j}", pl, count), pl.components, count))
            return out
        assert header.tiers is not None
        hi, lo = self._tier_layouts(header.tiers)  # type: ignore[attr-defined]
        mask = secs[f"tiers.{g}"].to(self.device)
        for prefix, pl, rows in ((f"{kind}.{g}", hi[kind][g], mask), (f"{kind}.{g}.lo", lo[kind][g], ~mask)):
            count = int(rows.sum())
            if count:
                out.append((rows, source(prefix, pl, count), pl.components, count))
        return out

    def decode_layers(
        self, blob: bytes, device: torch.device | str | None = None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(real layer index, keys, values)`` with keys/values ``[B, T, heads, head_dim]`` on ``device``
        (default: CPU), layer by layer. A sliding-window layer's tokens older than those it holds are zero.

        The GPU path hands over views of :meth:`decode`'s output while its products run. The CPU path reconstructs
        every layer first, a chunk of rows at a time (each layer's product multiplies the coefficients by that
        layer's basis columns only), so that it holds no more than :meth:`decode` does, then hands the layers over
        one by one (a layer the caller drops is freed)."""
        predicted = self._predicted(blob)
        if predicted is not None:
            token_map, emb = self._token_map()  # type: ignore[attr-defined]
        out_dev = torch.device(device) if device is not None else torch.device("cpu")
        fast = gpu_decode.decode_layers(self, blob) if self._fused and out_dev == self.device else None
        if fast is not None:
            if predicted is not None:
                fast = prediction.add_to_layers(fast, predicted[0], token_map, emb, predicted[1])
            yield from fast
            return
        layers = self._layer_list(blob, out_dev)
        if predicted is not None:
            prediction.add_to_layer_list(layers, predicted[0], token_map, emb, predicted[1])
        layers.reverse()
        while layers:
            yield layers.pop()

    def _layer_list(self, blob: bytes, out_dev: torch.device) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Every layer's ``(real layer index, keys, values)``, as :meth:`decode_layers` yields them (not the GPU
        path's); one kind after the other, each kind's sections dropped once its layers are written."""
        header, secs = self._open(blob, on_device=True)
        secs.pop("positions", None)
        lay = header.layout
        B, T = header.batch, header.tokens
        dt = DTYPES[lay.dtype]
        hd = (len(lay.heads), lay.head_dim)
        esize = torch.empty((), dtype=dt).element_size()
        span_index = {sp: i for i, (sp, *_) in enumerate(header.spans)}
        out: dict[str, list[torch.Tensor]] = {}
        for kind in KINDS:
            flat = section_view(secs.pop(f"raw.{kind}"), dt, (spans.raw_bytes(header) // esize,), out_dev)
            blocks = spans.raw_blocks(flat, header)
            layers = []
            for sp, j, first, s, w, _ in spans.per_layer(header):
                prot = blocks[span_index[sp]]
                full = (torch.zeros if first else torch.empty)((B, T, *hd), dtype=dt, device=out_dev)
                full[:, first : first + s] = prot[:, :s, j]
                full[:, T - w :] = prot[:, s:, j]
                layers.append(full)
            del flat, blocks
            if header.mode == "kvtc" and header.middle_tokens:
                self._fill_layers(kind, header, secs, layers)
            _drop(secs, kind)
            out[kind] = layers
        return list(zip(lay.layers, out["keys"], out["values"]))

    def _fill_layers(
        self, kind: str, header: container.Header, secs: dict[str, Any], layers: list[torch.Tensor]
    ) -> None:
        """Each layer's middle tokens of ``kind`` into ``layers`` (``[B, T, H, D]`` each): per PCA group, a chunk
        of rows at a time, each layer's columns multiplied by their own basis columns (the coefficients of a tiered
        or rate-ladder blob padded with zeros to the most components any of its plans keeps)."""
        lay = header.layout
        B = header.batch
        tr = self._transform
        clock = stage_clock(None)
        # larger chunks than decode's (a layer's products are small: the coefficients are most of a chunk), so that
        # each layer's product runs on fewer, larger blocks of rows
        chunk = chunk_bytes(budget.decoded_output_bytes(header), 8)
        cols_all = self.calibration.columns  # type: ignore[union-attr]
        per = len(lay.heads) * lay.head_dim
        work = Scratch()
        for g, (start, m) in enumerate(spans.group_middles(header, self.calibration.grouping)):  # type: ignore[union-attr]
            if not m:
                continue
            parts = self._parts(kind, g, header, secs, clock, B * m, chunk, work)
            k = max(c for _, _, c, _ in parts)
            width = tr.coefficient_columns(k)
            index = {c: i for i, c in enumerate(cols_all[g].tolist())}
            targets = []  # (layer, columns in the layer or None for all, its basis columns and mean)
            for li, layer in enumerate(lay.layers):
                lcols = [c for h in lay.heads for c in lay.pair_columns(layer, h)]
                idx = [(a, index[col]) for a, col in enumerate(lcols) if col in index]
                if not idx:
                    continue
                dst = torch.tensor([a for a, _ in idx])
                src = torch.tensor([b for _, b in idx], device=self.device)
                mean, basis = tr.basis_columns(kind, g, k, src)  # type: ignore[union-attr]
                view = spans.middle_view(layers[li].unsqueeze(2), start, m)
                targets.append((view, _subset(dst, per, view.device), mean, basis))
            cstep = chunk_rows(4 * width, chunk)  # rows decoded at once
            ystep = chunk_rows(4 * per, chunk)  # rows of one layer's columns reconstructed at once
            most = min(max(cstep, ystep) + MIN_CHUNK_ROWS, B * m) * max(width, per)  # elements to reserve
            done = [0] * len(parts)  # rows of each plan before the chunk
            for r0, r1 in row_chunks(B * m, B * m if self._fused else cstep):
                if len(parts) == 1 and parts[0][0] is None:
                    c = parts[0][1](r0, r1)
                else:  # a tiered or rate-ladder blob: each plan's rows of the chunk, in place
                    c = None
                    for i, (rows, coeffs, _, _) in enumerate(parts):
                        sel = rows[r0:r1]  # type: ignore[index]
                        got = int(sel.sum())
                        if not got:
                            continue
                        part = coeffs(done[i], done[i] + got)
                        done[i] += got
                        if c is None:
                            c = work.tensor("padded", (r1 - r0, width), part.dtype, part.device, most).zero_()
                        c[sel.to(part.device), : part.shape[1]] = part
                    assert c is not None
                for view, dst, mean, basis in targets:
                    for a, b in row_chunks(r1 - r0, r1 - r0 if self._fused else ystep):
                        y = (
                            None
                            if self._fused
                            else work.tensor("y", (b - a, basis.shape[1]), torch.float32, c.device, most)
                        )
                        y = tr.product(c[a:b], mean, basis, y)  # type: ignore[union-attr]
                        for w0, w1 in row_chunks(b - a, ystep):
                            _put_rows(view, r0 + a + w0, y[w0:w1], dst, work, most)
                        del y
                del c


def _subset(cols: torch.Tensor, width: int, device: torch.device) -> torch.Tensor | None:
    """``cols`` on ``device``, or None where they are every one of ``width`` columns, in order."""
    if len(cols) == width and bool((cols.cpu() == torch.arange(width)).all()):
        return None
    return cols.to(device)


def _put_rows(
    mv: torch.Tensor,
    at: int | torch.Tensor,
    y: torch.Tensor,
    cols: torch.Tensor | None,
    work: Scratch | None = None,
    most: int = 0,
) -> None:
    """Write reconstructed rows ``y [r, p]`` into ``mv [B, m, features]`` (a PCA group's middle tokens), cast to its
    dtype: the rows numbered sequence-major (row ``b·m + t`` is token ``t`` of sequence ``b``) from ``at`` on, or at
    the row numbers ``at`` (int64 ``[r]``); ``cols``: the features ``y``'s columns go to (None: all, in order).
    ``work``: where a cast copy is made (reserving ``most`` elements)."""
    m = mv.shape[1]
    if isinstance(at, int):
        r0, r1 = at, at + y.shape[0]
        for b in range(r0 // m, -(-r1 // m)):
            t0, t1 = max(r0 - b * m, 0), min(r1 - b * m, m)
            seg = y[b * m + t0 - r0 : b * m + t1 - r0]
            if cols is None:
                mv[b, t0:t1].copy_(seg)
            else:
                mv[b, t0:t1, cols] = _cast(seg, mv, work, most)
        return
    at = at.to(mv.device)
    b, t = at // m, at % m
    v = _cast(y, mv, work, most)
    if cols is None:
        mv[b, t] = v
    else:
        mv[b[:, None], t[:, None], cols] = v


def _cast(y: torch.Tensor, like: torch.Tensor, work: Scratch | None, most: int) -> torch.Tensor:
    """``y`` in ``like``'s dtype and device (in ``work``'s buffer when given)."""
    if y.dtype == like.dtype and y.device == like.device:
        return y
    if work is None:
        return y.to(like.dtype).to(like.device)
    return work.tensor("cast", tuple(y.shape), like.dtype, like.device, most).copy_(y)


def _drop(secs: dict[str, Any], kind: str) -> None:
    """Forget ``kind``'s decoded sections: its raw tokens, its groups' parameters and planes, its rung indices."""
    for name in [x for x in secs if x.startswith((f"raw.{kind}", f"{kind}.", f"rungs.{kind}."))]:
        del secs[name]
