"""``Codec``: KV slice <-> bytes, with a calibration and a target ratio.

Encode, per sequence: the ``sinks`` oldest and ``window`` newest tokens are stored raw; every other token
("middle") of keys and values is projected on its PCA group's basis (:class:`~kvtc.codec.transform.PCATransform`),
quantized by the bit plan and packed into component-major planes (:class:`~kvtc.codec.quantizer.Quantizer`), and
entropy coded into the container (:mod:`kvtc.codec.entropy`, :mod:`kvtc.codec.container`). Decode reverses it;
:meth:`Codec.decode_layers` yields one layer at a time so an engine can start on layer 0 before the rest is
reconstructed (on the GPU path: while the products are still running).

Sections of a ``kvtc`` blob, in order: ``positions`` (int64 ``[B, T]``), ``raw.keys`` and ``raw.values``
(protected tokens ``[B, s+w, L, H, D]`` in the slice dtype), then for ``kind`` in keys, values and PCA group
``g``: ``{kind}.{g}.params`` (fp16 ``[R, N]``: each kept group's per-token range parameters in plan order, a
row of N tokens each: shift then scale, or the scale alone for a scale-only type) and ``{kind}.{g}.{type}``
(packed planes, component order) for each type the plan uses, in :data:`CODED_TYPES` order.
An ``identity`` blob stores every token in ``raw.*`` and needs no calibration.

A tiered blob (token-adaptive rates, :mod:`kvtc.codec.tiers`; container version 3) codes each group's middle tokens
with two plans: after the raw sections one mask ``tiers.{g}`` per group (a bit per middle token, sequence-major:
set for the tokens of the high tier), then per kind and group the high tier's rows as ``{kind}.{g}.*`` and the low
tier's as ``{kind}.{g}.lo.*``, each tier's rows in token order.

A rate-ladder blob (container version 4, the default where the calibration records queries) codes each token of each
kind and PCA group with one of several plans (its *rung*): per kind and group a section ``rungs.{kind}.{g}`` (a byte
per middle token), then ``{kind}.{g}.params`` and ``{kind}.{g}.{type}`` holding every rung's rows, rung after rung
(the header's ``rung_counts`` size each part; :mod:`kvtc.codec.ladder` encodes them and locates each rung's rows).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .. import kernels
from ..calibration.artifact import KINDS, Calibration, ratio_key
from ..errors import CalibrationError, CalibrationMismatch, FormatError, LayoutError
from ..layout import DTYPES, KVSlice
from . import budget, container, gpu_decode, gpu_write, info, ladder, spans, tiers
from .buffers import device_bytes, host_bytes, le_bytes, section_tensor
from .clock import Clock, stage_clock
from .entropy import DEFAULT_BACKEND, Int64s, Precoded, device_coder, get_backend
from .packing import PACKINGS
from .quantizer import CODED_TYPES, PlanLayout, Quantizer, plan_layouts
from .transform import PRECISIONS, PCATransform

#: the paper's protected tokens: 4 attention sinks, 128 most recent tokens
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 128
#: a GPU decode writes a sequence's middle tokens straight into the output when it has at least this many
#: (one matmul per sequence; shorter ones take a single matmul and one copy)
DIRECT_MIN_TOKENS = 512


class Codec:
    """KVTC encoder/decoder for one calibration and target ratio.

    ``Codec(calibration, ratio=16)``; ``encode(slice) -> bytes``; ``decode(bytes) -> KVSlice``;
    ``inspect(bytes) -> dict``. ``Codec.identity()`` stores raw tokens through the same container.

    ``tiers`` (encoding only; any codec of the calibration decodes any of its blobs): ``"auto"`` (default) codes
    with the rate ladder (:func:`kvtc.codec.tiers.ladder_rungs`: each token of each kind and group by the plan from
    target/8 to 8x target that serves it best for the bytes, weighted by the attention the newest tokens' predicted
    queries give it, at one price for the whole blob) when the calibration records queries and has plans on both sides of the target, else as
    ``"two"``; ``"two"``: recipe r13's two tiers (:func:`kvtc.codec.tiers.auto_pair`, container version 3);
    ``"none"``: one plan for every token; ``(high, low)``: two tiers at those targets (raises
    :class:`~kvtc.errors.CalibrationError` when the calibration cannot).
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
        max_decoded_bytes: int = budget.DEFAULT_MAX_DECODED_BYTES,
        tiers: str | tuple[float, float] = "auto",
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
        if self._fused and precision == "fp8" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError("precision='fp8' needs a GPU with fp8 tensor cores (compute capability 8.9 or newer)")
        self._quantizer = Quantizer(self.device, self._fused)
        self._transform: PCATransform | None = None
        self._plans: dict[str, list[PlanLayout]] = {}
        if calibration is not None:
            self._transform = PCATransform(calibration, self.device, precision, self._fused)
            calibration.plans_for(self.ratio)  # a ratio it has no plan for raises here, naming the ones it has
            self._plans = plan_layouts(calibration, self.ratio)
        #: (high, low, share) of a two-tier encode (container version 3), or None
        self.tiers: tuple[str, str, float] | None = None
        #: the rungs (ratio keys) of a rate-ladder encode (container version 4), or None
        self.ladder: tuple[str, ...] | None = None
        if calibration is not None:
            self.tiers, self.ladder = _resolve_tiers(calibration, float(self.ratio), tiers)
        self._rope = None
        if (self.tiers is not None or self.ladder is not None) and calibration.rope is not None:
            from ..rope import RopeSpec

            self._rope = RopeSpec.from_dict(calibration.rope)

    @classmethod
    def identity(cls, backend: str = "raw", **kw: Any) -> Codec:
        """Stores every token raw in the container (debugging, lossless reference paths)."""
        return cls(None, None, backend=backend, **kw)

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
        clock = stage_clock(timings)
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
        if self.tiers is not None and header.middle_tokens:
            header.tiers = self.tiers
        if self.ladder is not None and header.middle_tokens:
            header.rungs, header.rung_counts = self.ladder, {kind: [] for kind in KINDS}
        budget.check_sparsity(header)
        payloads: list[tuple[str, Any]] = [("positions", Int64s(le_bytes(kv.positions)))]
        for kind, t in (("keys", kv.keys), ("values", kv.values)):
            prot = spans.protected(t, header)
            payloads.append((f"raw.{kind}", device_bytes(prot) if self._on_fused_device(prot) else le_bytes(prot)))
        if self.calibration is not None and header.middle_tokens:
            middles = spans.group_middles(header, self.calibration.grouping)
            one_group = len(middles) == 1
            masks: list[torch.Tensor | None] | None = None
            mass = None
            if header.rungs:
                with clock("tiers"):
                    mass = self._attention_mass(kv)
            if header.tiers:
                with clock("tiers"):
                    masks = self._choose_tiers(kv, header, middles)
                payloads.extend((f"tiers.{g}", tiers.pack_mask(mk)) for g, mk in enumerate(masks) if mk is not None)
            ladder_rows: dict[str, list[torch.Tensor | None]] = {}
            for kind, t in (("keys", kv.keys), ("values", kv.values)):
                rows: dict[tuple[int, int], torch.Tensor] = {}
                for start, m in dict.fromkeys(middles):
                    if m:
                        with clock("to_rows"):
                            r = spans.middle_view(t, start, m)  # [B, m, features]
                            in_place = self._fused and self.precision == "fp8" and self._same_gpu(t) and one_group
                            if not in_place or masks is not None:
                                r = r.reshape(-1, lay.num_features).to(
                                    self.device
                                )  # else the projection reads in place
                                if not (self._fused and self.precision in ("bf16", "fp8")):
                                    r = r.float()
                        rows[(start, m)] = r
                group_rows = [rows.get(x) for x in middles]
                if mass is not None:
                    ladder_rows[kind] = group_rows
                else:
                    payloads.extend(self._encode_rows(kind, group_rows, clock, masks))
            if mass is not None:
                payloads.extend(ladder.encode(self, ladder_rows, middles, mass, header, clock))
        with clock("entropy"):
            coder = device_coder(self.backend, self.device) if self._fused else None
            if (
                coder is not None
                and gpu_write.supported(coder)
                and any(isinstance(d, torch.Tensor) for _, d in payloads)
            ):
                return gpu_write.write(header, payloads, self.backend, coder, timings, out)
            payloads = self._host_payloads(payloads, clock)
            return container.write(header, payloads, self.backend, timings, out)

    def _same_gpu(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies on this codec's CUDA device (``cuda`` and ``cuda:N`` alike)."""
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return t.is_cuda and t.device.index == idx

    def _on_fused_device(self, t: torch.Tensor) -> bool:
        return self._fused and t.device.type == "cuda"

    def _host_payloads(self, payloads: list[tuple[str, Any]], clock: Clock) -> list[tuple[str, Any]]:
        """Device-resident payloads -> entropy-coded on the GPU (when the backend has a GPU coder) or copied
        to host bytes; what the container writes is the same either way."""
        dev = [i for i, (_, d) in enumerate(payloads) if isinstance(d, torch.Tensor)]
        if not dev:
            return payloads
        out = list(payloads)
        coder = device_coder(self.backend, self.device)
        if coder is not None:
            with clock("gpu_entropy"):
                coded = coder.encode([payloads[i][1] for i in dev])
            for i, c in zip(dev, coded):
                name, d = payloads[i]
                out[i] = (name, Precoded(self.backend, c, d.numel(), lambda d=d: host_bytes(d)))
        else:
            with clock("to_host"):
                for i in dev:
                    out[i] = (payloads[i][0], host_bytes(payloads[i][1]))
        return out

    def _choose_tiers(
        self, kv: KVSlice, header: container.Header, middles: list[tuple[int, int]]
    ) -> list[torch.Tensor | None]:
        """Each PCA group's high-tier mask (bool ``[B·middle]``; None for a group that codes no token)."""
        cal = self.calibration
        assert cal is not None and header.tiers is not None
        mass = self._attention_mass(kv)
        out: list[torch.Tensor | None] = []
        for g, (start, m) in enumerate(middles):
            layers = tiers.group_layers(cal.columns[g], kv.layout)
            out.append(tiers.choose(mass, layers, start, m, header.tiers[2]) if m else None)
        return out

    def _attention_mass(self, kv: KVSlice) -> torch.Tensor:
        """``[B, L, T]``: the attention each token of each layer receives from the slice's newest queries
        (:func:`kvtc.codec.tiers.attention_mass`)."""
        cal = self.calibration
        assert cal is not None and cal.queries is not None
        return tiers.attention_mass(
            kv.keys, kv.positions, kv.layout, cal.queries, cal.query_scales, self._rope, cal.query_map
        )

    def _encode_rows(
        self,
        kind: str,
        group_rows: list[torch.Tensor | None],
        clock: Clock,
        masks: list[torch.Tensor | None] | None = None,
    ) -> list[tuple[str, Any]]:
        """Sections of each PCA group from the rows ``[n, features]`` of its tokens (None: it codes none); with
        ``masks``, each group's high-tier rows by the high plan and the others by the low one."""
        out = []
        cols_all = self.calibration.columns  # type: ignore[union-attr]
        for g, pl in enumerate(self._plans[kind]):
            rows = group_rows[g]
            if rows is None:
                continue
            x = rows if len(cols_all) == 1 else rows[:, cols_all[g].to(rows.device)]
            parts = [(f"{kind}.{g}", pl, x)]
            if masks is not None:
                hi, lo = self._tier_layouts(self.tiers)  # type: ignore[arg-type]
                mk = masks[g].to(x.device)  # type: ignore[union-attr]
                parts = [(f"{kind}.{g}", hi[kind][g], x[mk]), (f"{kind}.{g}.lo", lo[kind][g], x[~mk])]
            for prefix, layout, part in parts:
                if not part.shape[0]:
                    continue
                with clock("project"):
                    coeffs = self._transform.project(kind, g, part, layout.components)  # type: ignore[union-attr]
                out.extend(self._quantizer.encode(prefix, coeffs, layout, self.packing, clock))
        return out

    def _tier_layouts(self, t: tuple[str, str, float]) -> tuple[dict[str, list[PlanLayout]], ...]:
        return plan_layouts(self.calibration, t[0]), plan_layouts(self.calibration, t[1])

    # ------------------------------------------------------------------ decode
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
        budget.check_budget(header, len(blob), self.max_decoded_bytes)
        if header.mode == "kvtc":
            cal = self.calibration
            if cal is None or header.calibration != cal.hash:
                raise CalibrationMismatch(
                    f"blob was encoded with calibration {str(header.calibration)[:16]}, this codec has "
                    f"{'none' if cal is None else cal.fingerprint}; decode with the calibration that encoded it"
                )
            cal.check_layout(header.layout)
            if header.adaptive:
                missing = [r for r in (header.rungs or header.tiers[:2]) if r not in cal.plans]  # type: ignore[index]
                if missing:
                    raise FormatError(f"blob names tier ratios {missing}, which its calibration has no plan for")
            elif header.ratio is None or header.ratio not in cal.plans:
                raise FormatError(f"blob names ratio {header.ratio!r}, which its calibration has no plan for")
        return blob, pinned, header, body

    def _expected_sections(self, h: container.Header, hints: dict[str, Any] | None = None) -> dict[str, int]:
        """Each section's exact raw size, from the header and the calibration; ``hints`` receives each fixed-step
        plane's ``gauss`` model (:class:`kvtc.codec.gaussian.Hint`)."""
        exp = {"positions": 8 * h.batch * h.tokens}
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

    def decode(
        self,
        blob: bytes | torch.Tensor,
        timings: dict[str, float] | None = None,
        device: torch.device | str | None = None,
    ) -> KVSlice:
        """Reconstruct the slice a blob holds (keys pre-RoPE, in the layout's dtype), on ``device``
        (default: CPU). ``blob``: bytes, or a 1-D uint8 CPU tensor holding them (pinned host memory lets a GPU
        codec copy the coded streams to the device without staging)."""
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
        if len(header.spans) == 1:  # the one raw block, shaped
            s, w = header.spans[0][2:4]
            blocks = {k: [flat[k].view(B, s + w, len(lay.layers), *hd)] for k in KINDS}
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

    # ------------------------------------------------------------------ inspect
    @staticmethod
    def inspect(blob: bytes | memoryview | torch.Tensor) -> dict[str, Any]:
        """Header facts and sizes of a blob, without decoding it (needs no calibration): see
        :func:`kvtc.codec.info.inspect`."""
        return info.inspect(blob)


def _resolve_tiers(
    cal: Calibration, ratio: float, asked: Any
) -> tuple[tuple[str, str, float] | None, tuple[str, ...] | None]:
    """``((high, low, share), None)`` for a two-tier encode, ``(None, rungs)`` for a rate ladder, ``(None, None)``
    for one plan: what a codec of ``cal`` at ``ratio`` asked for ``asked`` tiers codes with."""
    if asked == "none":
        return None, None
    if asked == "auto":
        rungs = tiers.ladder_rungs(cal, ratio)
        if rungs is not None:
            return None, rungs
        asked = "two"  # a calibration whose ladder does not bracket the target: two tiers where it has them
    if asked == "two":
        pair = tiers.auto_pair(cal, ratio)
        if pair is None:
            return None, None
        high, low = pair
    else:
        try:
            high, low = (float(x) for x in asked)
        except (TypeError, ValueError):
            raise ValueError(f"tiers must be 'auto', 'two', 'none' or (high, low) targets, got {asked!r}") from None
        if cal.queries is None:
            raise CalibrationError(
                "token-adaptive tiers need a calibration that records mean queries (format version 7: "
                "`kvtc calibrate` with the default recipe); this one does not"
            )
        for r in (high, low):
            cal.plans_for(r)  # raises, naming the ratios it has
        if not high < ratio < low:
            raise ValueError(f"tier targets must bracket the target: {high:g} < {ratio:g} < {low:g}")
    return (ratio_key(high), ratio_key(low), round(tiers.share(ratio, high, low), 6)), None


__all__ = ["CODED_TYPES", "DEFAULT_SINKS", "DEFAULT_WINDOW", "DIRECT_MIN_TOKENS", "Codec"]
