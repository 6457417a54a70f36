"""``Codec``: KV slice <-> bytes, with a calibration and a target ratio.

Encode, per sequence: the ``sinks`` oldest and ``window`` newest tokens are stored raw; every other token
("middle") of keys and values is projected on its PCA group's basis (:class:`~kvtc.codec.transform.PCATransform`),
quantized by the bit plan and packed into component-major planes (:class:`~kvtc.coding.quantizer.Quantizer`), and
entropy coded into the container (:mod:`kvtc.coding.entropy`, :mod:`kvtc.codec.container`). Decode reverses it;
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

With a calibration that carries a token map (container version 5, :mod:`kvtc.codec.prediction`), section ``tokens``
(the token ids, int32 ``[B, T]``) follows ``positions``, and the coded sections hold each middle token's K/V less the
map's prediction from those ids; decoding adds it back, from the model's input embeddings (``embeddings=``).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import kernels
from ..calibration.artifact import KINDS, Calibration, ratio_key
from ..coding.buffers import device_bytes, host_bytes, le_bytes
from ..coding.clock import Clock, stage_clock
from ..coding.entropy import DEFAULT_BACKEND, Int64s, Precoded, device_coder, encode_stream, get_backend
from ..coding.packing import PACKINGS
from ..coding.quantizer import CODED_TYPES, PlanLayout, Quantizer, plan_layouts
from ..errors import LayoutError
from ..layout import KVSlice
from . import attention, budget, container, gpu_write, info, ladder, prediction, spans, tiers
from .decoding import DIRECT_MIN_TOKENS, Decoding
from .tiers import resolve as resolve_tiers
from .transform import PRECISIONS, PCATransform

#: the paper's protected tokens: 4 attention sinks, 128 most recent tokens
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 128


class Codec(Decoding):
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

    ``embeddings``: the model's input embedding table (``model.get_input_embeddings().weight``), needed when the
    calibration carries a token map (:attr:`needs_token_ids`): :meth:`encode` then also takes the token ids, and
    the blob carries them. The table is checked against the calibration's (:class:`~kvtc.errors.CalibrationMismatch`).
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
        embeddings: torch.Tensor | None = None,
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
            self.tiers, self.ladder = resolve_tiers(calibration, float(self.ratio), tiers)
        self._embeddings: torch.Tensor | None = None
        if embeddings is not None:
            self.use_embeddings(embeddings)
        self._rope = None
        if (self.tiers is not None or self.ladder is not None) and calibration.rope is not None:
            from ..rope import RopeSpec

            self._rope = RopeSpec.from_dict(calibration.rope)

    @property
    def needs_token_ids(self) -> bool:
        """Whether the calibration carries a token map: :meth:`encode` then needs the token ids, and encoding and
        decoding the model's input embeddings."""
        return self.calibration is not None and self.calibration.token_map is not None

    def use_embeddings(self, embeddings: torch.Tensor) -> None:
        """Give the model's input embedding table (checked against the calibration's token map; ignored without
        one)."""
        if self.needs_token_ids:
            self._embeddings = self.calibration.token_map.check_embeddings(embeddings)

    def _token_map(self) -> tuple[Any, torch.Tensor]:
        """The calibration's token map and the embeddings, or a CalibrationMismatch saying what to pass."""
        if self._embeddings is None:
            self.calibration.token_map.check_embeddings(None)  # raises, saying what to pass
        return self.calibration.token_map, self._embeddings

    @classmethod
    def identity(cls, backend: str = "raw", **kw: Any) -> Codec:
        """Stores every token raw in the container (debugging, lossless reference paths)."""
        return cls(None, None, backend=backend, **kw)

    # ------------------------------------------------------------------ encode
    def encode(
        self, kv: KVSlice, timings: dict[str, float] | None = None, out: Any = None, token_ids: Any = None
    ) -> Any:
        """Compress a slice (keys pre-RoPE) to a self-describing blob (``bytes``).

        ``token_ids``: int ``[batch, tokens]`` (``[tokens]`` for one sequence), the ids the KV was computed from
        (default: the slice's ``token_ids``); required when the calibration carries a token map
        (:attr:`needs_token_ids`), ignored otherwise.

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
        exact = kv  # the attention the ladder weighs tokens by is the exact keys'
        payloads: list[tuple[str, Any]] = [("positions", Int64s(le_bytes(kv.positions)))]
        reserve = 0.0  # bytes beyond what the plans count: the token ids of a version-5 blob, as they will be coded
        if self.needs_token_ids and header.middle_tokens:
            ids = prediction.check_ids(kv.token_ids if token_ids is None else token_ids, B, T)
            token_map, emb = self._token_map()
            header.predicted = True
            with clock("predict"):
                kv = prediction.shift(kv, header, token_map, emb, ids, -1.0)
            data = prediction.ids_bytes(ids)
            reserve = float(len(encode_stream(data, self.backend)[1]))
            payloads.append((prediction.SECTION, data))
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
                    mass = self._attention_mass(exact)
            if header.tiers:
                with clock("tiers"):
                    masks = self._choose_tiers(exact, header, middles)
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
                payloads.extend(ladder.encode(self, ladder_rows, middles, mass, header, clock, reserve))
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
        (:func:`kvtc.codec.attention.attention_mass`)."""
        cal = self.calibration
        assert cal is not None and cal.queries is not None
        return attention.attention_mass(
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

    # ------------------------------------------------------------------ inspect
    @staticmethod
    def inspect(blob: bytes | memoryview | torch.Tensor) -> dict[str, Any]:
        """Header facts and sizes of a blob, without decoding it (needs no calibration): see
        :func:`kvtc.codec.info.inspect`."""
        return info.inspect(blob)


__all__ = ["CODED_TYPES", "DEFAULT_SINKS", "DEFAULT_WINDOW", "DIRECT_MIN_TOKENS", "Codec"]
