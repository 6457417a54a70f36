"""The calibration artifact: one safetensors file (tensors) with a JSON metadata entry, content-hashed.

Tensors, for ``kind`` in ``keys``/``values`` and PCA group index ``g``:

* ``{kind}.{g}.mean``        float32 ``[p_g]``
* ``{kind}.{g}.basis``       float16 ``[k, p_g]`` — rows are components (the one orientation in kvtc). A
  calibration rounds a fitted float32 basis to float16 when it is made, so the object a fit returns holds what its
  file holds and has the same ``hash``: a blob encoded with it decodes with the file. A coder takes the basis to
  float32 (:meth:`~kvtc.calibration.pca.PCAResult.coder_basis`)
  and computes in float32; the rounding (at most 2^-11 relative per entry) moves a projection and reconstruction
  by about 1e-7 of the signal's energy, far below any plan's quantization error
* ``{kind}.{g}.eigenvalues`` float32 ``[k]``
* ``{kind}.{g}.scale``       float32 ``[p_g]``, positive — only in a sensitivity-weighted calibration: the group's
  PCA was fitted on rows ``x ∘ scale`` (see :class:`~kvtc.calibration.pca.PCAResult`)
* ``queries`` float32 ``[layers, heads, G, head_dim]`` and ``queries.scale`` float32 ``[layers]`` — only in a
  calibration that records its mean queries: each attention head's mean pre-RoPE query over the
  calibration corpus (``G`` query heads per KV head) and the attention's logit scale per layer. The encoder ranks
  tokens by the attention they receive (:mod:`kvtc.codec.tiers`); decoding never reads them, so they are no part of
  the calibration's ``hash``
* ``queries.map`` ``[layers, heads, head_dim + 1, G · head_dim]`` — only beside ``queries``, in a calibration
  that also records the key-to-query map: ``[pre-RoPE key, 1] @ map[layer, head]`` predicts the
  pre-RoPE queries of the ``G`` query heads that read that KV head (a ridge regression on the calibration corpus).
  Encoder-only as well. Held as float32 on an int8 grid (rounded to it when the calibration is made, as the bases
  are to float16) and stored as ``queries.map`` int8 ``[layers, heads, head_dim, G · head_dim]`` (the key rows),
  ``queries.map.scale`` float32 ``[layers, heads, G · head_dim]`` (a power of two per column) and
  ``queries.map.bias`` float32 ``[layers, heads, G · head_dim]`` (the intercept): :func:`query_map_parts`
* ``tokens.mean``, ``tokens.std``, ``tokens.probe``, ``tokens.keys``, ``tokens.values`` (int8) and their column
  scales ``tokens.keys.scale``, ``tokens.values.scale`` — only in a calibration
  that carries a token map (:mod:`kvtc.calibration.token_map`): the codec codes each token's
  K/V less the map's prediction from its token ids, so they are part of the hash

The metadata key ``kvtc`` holds JSON: format name and version, library version, layout, PCA grouping,
RoPE spec (as the model adapter serialised it, or null), model id, corpus description, per-ratio bit plans
per kind and group, free-form statistics, ``hash`` (the calibration's name: what decoding depends on) and
``checksum`` (the whole file), see :mod:`kvtc.calibration.digest`. Loading recomputes both and validates every
shape before anything is used; it never executes code (no pickle). The format version is
:data:`~kvtc.calibration.meta.FORMAT_VERSION` (11); a calibration whose recorded recipe (``stats["recipe"]``) holds
a choice the current :class:`~kvtc.calibration.recipe.Recipe` lacks is refused too
(:func:`~kvtc.calibration.recipe.check_recorded`). Older recipes (r9-r15) and files (versions 1-10) are refused:
rebuild.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from .. import __version__
from ..errors import CalibrationError, CalibrationMismatch, LayoutError
from ..fileio import write_atomic
from ..layout import KVLayout, PCAGrouping
from ..quant import DROP
from ..textsafe import printable
from .digest import content_hash, decoding_hash
from .meta import FORMAT_NAME, FORMAT_VERSION, header_length, kvtc_meta, read_header, tensor_names
from .pca import PCAResult
from .plan import PAPER_TYPES, Plan
from .recipe import check_recorded
from .token_map import MAX_WEIGHT_SCALE, TokenMap, quantize_weights
from .validation import check_tensors, shard, validate

KINDS = ("keys", "values")


def ratio_key(ratio: float) -> str:
    """Canonical text of a target ratio (``16`` -> ``"16"``, ``2.5`` -> ``"2.5"``)."""
    r = float(ratio)
    if not r > 0:
        raise CalibrationError(f"compression ratio must be positive, got {ratio}")
    return format(r, "g")


@dataclass
class Calibration:
    """Everything the codec needs about a model: PCA bases and bit plans, per kind and PCA group.

    ``pcas[kind][g]`` is a :class:`PCAResult`; ``plans[ratio_key][kind][g]`` a :class:`Plan`. Each basis is held
    in float16: a float32 one given to the constructor is rounded to it there, once.
    """

    layout: KVLayout
    grouping: PCAGrouping
    pcas: dict[str, list[PCAResult]]
    plans: dict[str, dict[str, list[Plan]]]
    rope: dict[str, Any] | None = None
    model_id: str = ""
    corpus: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    library_version: str = __version__
    #: ``[layers, heads, G, head_dim]`` mean pre-RoPE query per attention head (None: not recorded; blobs then
    #: spend one plan on every middle token) and ``[layers]`` logit scales
    queries: torch.Tensor | None = None
    query_scales: torch.Tensor | None = None
    query_map: torch.Tensor | None = None
    #: the prediction of each token's K/V from its token ids that the codec codes the residual of (None: none)
    token_map: TokenMap | None = None

    def __post_init__(self) -> None:
        self._columns = self.grouping.columns(self.layout)
        self._round_bases()
        self.validate()
        self.hash = self._compute_hash()

    def _round_bases(self) -> None:
        """Hold every basis in float16 (rounding a float32 one) and the key-to-query map on its int8 grid
        (:func:`query_map_parts`): what the file will store, so that a calibration and its saved file are one.
        ``pcas`` is rebuilt, never changed in place (the caller's lists and results stay as they were); malformed
        ``pcas`` and maps are left to :meth:`validate`."""
        m = self.query_map
        if isinstance(m, torch.Tensor) and m.is_floating_point() and m.dim() == 4 and m.shape[2] > 1:
            self.query_map = query_map_dense(*query_map_parts(m))
        dtype = torch.float16
        if not isinstance(self.pcas, dict):
            return
        self.pcas = {
            kind: [
                dataclasses.replace(p, basis=p.basis.to(dtype))
                if isinstance(p, PCAResult) and p.basis.is_floating_point() and p.basis.dtype != dtype
                else p
                for p in pcas
            ]
            if isinstance(pcas, list)
            else pcas
            for kind, pcas in self.pcas.items()
        }

    # ------------------------------------------------------------------ queries
    @property
    def columns(self) -> list[torch.Tensor]:
        """Feature columns of each PCA group."""
        return self._columns

    @property
    def ratios(self) -> list[float]:
        return sorted(float(r) for r in self.plans)

    def plan(self, ratio: float, kind: str, group: int) -> Plan:
        return self.plans_for(ratio)[kind][group]

    def plans_for(self, ratio: float) -> dict[str, list[Plan]]:
        key = ratio_key(ratio)
        if key not in self.plans:
            have = ", ".join(ratio_key(r) for r in self.ratios) or "none"
            raise CalibrationError(
                f"this calibration has no bit plan for ratio {key} (it has: {have}); "
                f"pick one of those or recalibrate with `kvtc calibrate --ratios ... {key}`"
            )
        return self.plans[key]

    @property
    def fingerprint(self) -> str:
        """Short form of the content hash, used to name the calibration in blobs and store keys."""
        return self.hash[:16]

    def check_layout(self, layout: KVLayout, model: str = "the KV") -> None:
        """Refuse KV of another shape than the calibration's (heads may be a subset: a TP shard)."""
        mine = self.layout
        if layout.model_shape != mine.model_shape:
            raise CalibrationMismatch(
                f"the calibration was made for another model ({printable(self.model_id or 'unnamed', 80)}: layers "
                f"{_short(mine.layers)}, {mine.num_kv_heads} KV heads, head_dim {mine.head_dim}) than {model} "
                f"(layers {_short(layout.layers)}, {layout.num_kv_heads} KV heads, head_dim {layout.head_dim}); "
                "use a calibration made for this model (`kvtc calibrate --model ...`)"
            )
        if layout.heads != mine.heads:
            raise CalibrationMismatch(
                f"KV heads {layout.heads} differ from the calibration's {mine.heads}; "
                "slice the calibration for this shard with `calibration.shard(heads)`"
            )

    def check_model(self, layout: KVLayout, rope: Any, model: str = "the model") -> None:
        """The one check that this calibration fits a served model, used by every engine integration.

        ``layout`` is the model's KV layout (or a tensor-parallel shard of it) and ``rope`` its
        :class:`~kvtc.rope.RopeSpec`. A calibration of another model is named as such (its layout differs)
        before RoPE is compared; a calibration that records no RoPE is refused, since its keys' basis is
        unknown.
        """
        from ..rope import RopeSpec

        self.check_layout(layout, model)
        if self.rope is None:
            raise CalibrationMismatch("the calibration records no RoPE spec; recalibrate with `kvtc calibrate`")
        theirs = RopeSpec.from_dict(self.rope)
        if theirs.fingerprint() != rope.fingerprint():
            raise CalibrationMismatch(
                f"{model}'s RoPE ({rope.fingerprint()}) differs from the calibration's ({theirs.fingerprint()}): "
                "it was made for another model or configuration; recalibrate with `kvtc calibrate --model ...`"
            )

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Every tensor's shape, dtype and finiteness against the layout and grouping, every plan against its basis
        (:func:`~kvtc.calibration.validation.validate`); raises :class:`CalibrationError`."""
        validate(self)

    # ------------------------------------------------------------------ serialisation
    @property
    def weighted(self) -> bool:
        """True when the PCA was fitted on sensitivity-weighted rows (feature scales stored)."""
        return any(p.scale is not None for kind in KINDS for p in self.pcas[kind])

    @property
    def types(self) -> frozenset[int]:
        """The quantization type codes its plans use."""
        return frozenset(t for by in self.plans.values() for k in KINDS for pl in by[k] for _, t, _ in pl.segments)

    @property
    def extended_types(self) -> bool:
        """True when some plan uses a quantization type beyond the paper's (int2, int4, fp8)."""
        return not self.types <= {DROP, *PAPER_TYPES}

    @property
    def version(self) -> int:
        """The format version it is saved in (:data:`~kvtc.calibration.meta.FORMAT_VERSION`)."""
        return FORMAT_VERSION

    def feature_scale(self, kind: str) -> torch.Tensor | None:
        """The ``[p]`` feature scale of ``kind`` over the whole layout (None when unweighted)."""
        if not self.weighted:
            return None
        out = torch.ones(self.layout.num_features, dtype=torch.float32)
        for pca, cols in zip(self.pcas[kind], self._columns):
            if pca.scale is not None:
                out[cols] = pca.scale
        return out

    def _meta(self) -> dict[str, Any]:
        pca_info = {
            kind: [{"total_variance": p.total_variance, "samples": p.samples} for p in self.pcas[kind]]
            for kind in KINDS
        }
        if self.weighted:
            for kind in KINDS:
                for info, p in zip(pca_info[kind], self.pcas[kind]):
                    info["scaled"] = p.scale is not None
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "library_version": self.library_version,
            "layout": self.layout.to_dict(),
            "grouping": self.grouping.to_dict(),
            "rope": self.rope,
            "model_id": self.model_id,
            "corpus": self.corpus,
            "stats": self.stats,
            "pca": pca_info,
            "plans": {
                key: {kind: [pl.to_dict() for pl in by_kind[kind]] for kind in KINDS}
                for key, by_kind in sorted(self.plans.items())
            },
            **({} if self.queries is None else {"queries": self._queries_meta()}),
            **({} if self.token_map is None else {"token_map": self.token_map.meta()}),
        }

    def _queries_meta(self) -> dict[str, Any]:
        assert self.queries is not None
        out: dict[str, Any] = {"per_kv_head": int(self.queries.shape[2])}
        if self.query_map is not None:
            out["map"] = True
        return out

    def _tensors(self, queries: bool = True) -> dict[str, torch.Tensor]:
        """The file's tensors by name; without ``queries``, those the decoder reads (the hash's)."""
        out = {}
        for kind in KINDS:
            for g, p in enumerate(self.pcas[kind]):
                out[f"{kind}.{g}.mean"] = p.mean.contiguous()
                out[f"{kind}.{g}.basis"] = p.basis.contiguous()
                out[f"{kind}.{g}.eigenvalues"] = p.eigenvalues.contiguous()
                if p.scale is not None:
                    out[f"{kind}.{g}.scale"] = p.scale.contiguous()
        if queries and self.queries is not None and self.query_scales is not None:
            out["queries"] = self.queries.contiguous()
            out["queries.scale"] = self.query_scales.contiguous()
            if self.query_map is not None:
                q, scale, bias = query_map_parts(self.query_map)
                out.update({"queries.map": q, "queries.map.scale": scale, "queries.map.bias": bias})
        if self.token_map is not None:
            out.update(self.token_map.tensors())
        return out

    def _compute_hash(self) -> str:
        decoding = self._tensors(queries=False)  # the encoder's query statistics are not part of the hash
        return decoding_hash(self.layout, self.grouping, self.rope, self.plans, decoding)

    def to_bytes(self) -> bytes:
        meta = self._meta()
        meta["hash"] = self.hash
        tensors = self._tensors()
        meta["checksum"] = content_hash(meta, tensors, skip="checksum")
        return save(tensors, metadata={"kvtc": json.dumps(meta, sort_keys=True)})

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (temp file, fsync, rename): a crash never leaves a half-written calibration."""
        return write_atomic(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        """Load and fully validate a calibration file. Raises :class:`CalibrationError` on anything wrong.

        The safetensors header is read and bounded here (:func:`~kvtc.calibration.meta.read_header`), the kvtc
        metadata validated and the tensor table matched against it, before safetensors reads anything."""
        path = Path(path)
        if not path.is_file():
            raise CalibrationError(f"calibration file {path} does not exist; create one with `kvtc calibrate`")
        try:
            with open(path, "rb") as raw:
                size = os.fstat(raw.fileno()).st_size
                n = header_length(raw.read(8), size, path)
                table, metadata = read_header(raw.read(n), path)
            meta = kvtc_meta(metadata, path)
            expected = tensor_names(meta)
            if set(table) != expected:
                raise CalibrationError(
                    f"{path}: tensors {_names(set(table) ^ expected)} missing or unexpected; the file is corrupt"
                )
            with safe_open(str(path), framework="pt") as f:
                # the file read twice: refuse one that changed in between
                if (f.metadata() or {}) != metadata or set(f.keys()) != expected:
                    raise CalibrationError(f"{path} changed while it was read; load it again")
                tensors = {name: f.get_tensor(name) for name in sorted(expected)}
        except SafetensorError as e:
            raise CalibrationError(f"{path} is not a readable calibration file ({printable(e)}); recreate it") from None
        except (OSError, ValueError) as e:
            if isinstance(e, CalibrationError):
                raise
            raise CalibrationError(f"cannot read calibration {path}: {printable(e)}") from None
        return cls.from_parts(meta, tensors, source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes) -> Calibration:
        """A calibration from a file's bytes, checked as :meth:`load` checks a file."""
        from safetensors.torch import load

        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CalibrationError(f"a calibration is read from bytes, not {type(data).__name__}")
        data = bytes(data)
        # the header first, bounded, and the metadata validated (safetensors.torch.load drops it) before the tensors
        n = header_length(data[:8], len(data), "<bytes>")
        table, metadata = read_header(data[8 : 8 + n], "<bytes>")
        meta = kvtc_meta(metadata, "<bytes>")
        if set(table) != tensor_names(meta):
            raise CalibrationError("<bytes>: calibration tensors do not match its metadata; the file is corrupt")
        try:
            tensors = load(data)
        except Exception as e:  # safetensors raises several types for garbage input
            raise CalibrationError(f"not a calibration: {printable(e)}") from None
        if set(tensors) != tensor_names(meta):
            raise CalibrationError("calibration tensors do not match its metadata")
        return cls.from_parts(meta, tensors, source="<bytes>")

    @classmethod
    def from_parts(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor], source: str) -> Calibration:
        check_recorded(meta.get("stats", {}).get("recipe"), source)
        check_tensors(tensors, source)
        try:
            layout = KVLayout.from_dict(meta["layout"])
            grouping = PCAGrouping.from_dict(meta["grouping"])
            pcas: dict[str, list[PCAResult]] = {}
            for kind in KINDS:
                pcas[kind] = []
                for g, info in enumerate(meta["pca"][kind]):
                    pcas[kind].append(
                        PCAResult(
                            tensors[f"{kind}.{g}.mean"],
                            tensors[f"{kind}.{g}.basis"],
                            tensors[f"{kind}.{g}.eigenvalues"],
                            float(info["total_variance"]),
                            int(info["samples"]),
                            tensors[f"{kind}.{g}.scale"] if info.get("scaled") else None,
                        )
                    )
            plans = {
                str(key): {
                    kind: [Plan.from_dict(d, pcas[kind][g].basis.shape[0]) for g, d in enumerate(by_kind[kind])]
                    for kind in KINDS
                }
                for key, by_kind in meta["plans"].items()
            }
            cal = cls(
                layout=layout,
                grouping=grouping,
                pcas=pcas,
                plans=plans,
                rope=meta["rope"],
                model_id=str(meta["model_id"]),
                corpus=dict(meta["corpus"]),
                stats=dict(meta["stats"]),
                library_version=str(meta["library_version"]),
                queries=tensors.get("queries"),
                query_scales=tensors.get("queries.scale"),
                query_map=None
                if "queries.map" not in tensors
                else query_map_dense(
                    tensors["queries.map"], tensors["queries.map.scale"], tensors["queries.map.bias"], source
                ),
                token_map=None if meta.get("token_map") is None else TokenMap.from_parts(meta["token_map"], tensors),
            )
        except (KeyError, TypeError, ValueError, IndexError, LayoutError) as e:
            if isinstance(e, CalibrationError):
                raise
            raise CalibrationError(
                f"{source}: malformed calibration ({e!r}); recreate it with `kvtc calibrate`"
            ) from None
        if content_hash(meta, tensors, skip="checksum") != meta.get("checksum"):
            raise CalibrationError(
                f"{source}: checksum mismatch (file corrupt or edited); recalibrate (`kvtc calibrate`)"
            )
        if cal.hash != meta.get("hash"):
            raise CalibrationError(
                f"{source}: content hash mismatch (file corrupt or edited); recreate it with `kvtc calibrate`"
            )
        return cal

    # ------------------------------------------------------------------ derived calibrations
    def shard(self, heads: tuple[int, ...]) -> Calibration:
        """The calibration of a tensor-parallel rank holding ``heads`` (:func:`~kvtc.calibration.validation.shard`).

        Only possible when every PCA group lies within the shard (``PCAGrouping("head_shards", n)``)."""
        return shard(self, heads)


def query_map_parts(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The key-to-query map ``[L, H, D + 1, G·D]`` as a file stores it: the key rows as int8 ``[L, H, D, G·D]``
    with a power-of-two float32 scale per column ``[L, H, G·D]`` (:func:`~kvtc.calibration.token_map.quantize_weights`:
    a map on that grid is stored again as the same bytes), and the intercept row as float32 ``[L, H, G·D]``. The
    rounding moves the predicted queries by about 0.6% (SmolLM2-135M) and 0.9% (Gemma-3-270M) of their norm
    (docs/studies/calibration-size.md); the map only ranks tokens for the encoder."""
    q, scale = quantize_weights(m[:, :, :-1], dim=-2, power_of_two=True)
    return q.contiguous(), scale.contiguous(), m[:, :, -1].float().contiguous()


def query_map_dense(
    q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, source: Any = "calibration"
) -> torch.Tensor:
    """The float32 ``[L, H, D + 1, G·D]`` map of a file's parts (:func:`query_map_parts`), their shapes checked."""
    if not (
        q.dim() == 4 and scale.shape == bias.shape == (*q.shape[:2], q.shape[3]) and q.dtype == torch.int8
        and scale.dtype == bias.dtype == torch.float32
    ):  # fmt: skip
        raise CalibrationError(
            f"{source}: key-to-query map tensors of shapes {list(q.shape)}, {list(scale.shape)}, {list(bias.shape)} "
            "do not fit together; the file is corrupt: rebuild the calibration (`kvtc calibrate`)"
        )
    if not bool((scale <= MAX_WEIGHT_SCALE).all()):
        raise CalibrationError(
            f"{source}: key-to-query map column scales must be at most {MAX_WEIGHT_SCALE:.4g}; the file is corrupt: "
            "rebuild the calibration (`kvtc calibrate`)"
        )
    return torch.cat([q.float() * scale.unsqueeze(2), bias.unsqueeze(2)], 2)


def _names(names: set[str]) -> str:
    """A few of a file's tensor names, each made printable."""
    return ", ".join(repr(printable(n, 60)) for n in sorted(names)[:4]) + (" ..." if len(names) > 4 else "")


def _short(layers: tuple[int, ...]) -> str:
    return str(list(layers)) if len(layers) <= 6 else f"[{layers[0]}..{layers[-1]}] ({len(layers)})"
