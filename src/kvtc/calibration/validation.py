"""Checks and derivations of a :class:`~kvtc.calibration.artifact.Calibration` kept beside it: the validation of
every tensor and plan against the layout and grouping, and the cut of a tensor-parallel rank's shard. The artifact
imports this module, so ``cal`` is typed ``Any`` here and a shard is built by ``type(cal)``: no import back."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CalibrationError, CalibrationMismatch
from ..layout import KVLayout, PCAGrouping
from ..textsafe import printable
from .meta import _HOSTILE
from .token_map import STD_FLOOR

KINDS = ("keys", "values")


def validate(cal: Any) -> None:
    """Raise :class:`CalibrationError` unless every PCA, plan, query tensor and token map of ``cal`` fits its
    layout and grouping."""
    if set(cal.pcas) != set(KINDS):
        raise CalibrationError(f"calibration must have PCAs for {KINDS}, has {sorted(cal.pcas)}")
    ngroups = len(cal.columns)
    for kind in KINDS:
        if len(cal.pcas[kind]) != ngroups:
            raise CalibrationError(f"{kind}: {len(cal.pcas[kind])} PCA groups, grouping implies {ngroups}")
        for g, (pca, cols) in enumerate(zip(cal.pcas[kind], cal.columns)):
            pg = cols.numel()
            if pca.mean.shape != (pg,) or pca.basis.dim() != 2 or pca.basis.shape[1] != pg:
                raise CalibrationError(
                    f"{kind} group {g}: basis must be [k, {pg}] and mean [{pg}], got "
                    f"{tuple(pca.basis.shape)} and {tuple(pca.mean.shape)}"
                )
            if pca.basis.shape[0] > pg or pca.basis.shape[0] == 0:
                raise CalibrationError(f"{kind} group {g}: basis has {pca.basis.shape[0]} rows for p={pg}")
            if pca.scale is not None and pca.scale.shape != (pg,):
                raise CalibrationError(f"{kind} group {g}: feature scale must be [{pg}]")
            for name, t in (("mean", pca.mean), ("basis", pca.basis), ("eigenvalues", pca.eigenvalues)):
                want = torch.float16 if name == "basis" else torch.float32
                if t.dtype != want:
                    raise CalibrationError(f"{kind} group {g}: {name} must be finite {_name(want)}, got {t.dtype}")
    for key, by_kind in cal.plans.items():
        if set(by_kind) != set(KINDS):
            raise CalibrationError(f"ratio {key}: plans must cover {KINDS}")
        for kind in KINDS:
            if len(by_kind[kind]) != ngroups:
                raise CalibrationError(f"ratio {key} {kind}: {len(by_kind[kind])} plans for {ngroups} groups")
            for g, plan in enumerate(by_kind[kind]):
                if plan.num_components > cal.pcas[kind][g].basis.shape[0]:
                    raise CalibrationError(f"ratio {key} {kind} group {g}: plan needs more components than the basis")
    if (cal.queries is None) != (cal.query_scales is None):
        raise CalibrationError("mean queries and their logit scales come together")
    if cal.queries is not None:
        lay, q, sc = cal.layout, cal.queries, cal.query_scales
        if q.dim() != 4 or q.shape[:2] != (len(lay.layers), len(lay.heads)) or q.shape[3] != lay.head_dim:
            raise CalibrationError(
                f"mean queries must be [{len(lay.layers)}, {len(lay.heads)}, G, {lay.head_dim}], got {tuple(q.shape)}"
            )
        if not 1 <= q.shape[2] <= 1 << 10 or sc.shape != (len(lay.layers),):
            raise CalibrationError("mean queries: query heads per KV head or logit scales out of shape")
        for name, t in (("mean queries", q), ("query logit scales", sc)):
            if t.dtype != torch.float32:
                raise CalibrationError(f"{name} must be finite float32")
        m = cal.query_map
        if m is not None:
            want = (len(lay.layers), len(lay.heads), lay.head_dim + 1, q.shape[2] * lay.head_dim)
            if tuple(m.shape) != want:
                raise CalibrationError(f"key-to-query map must be {list(want)}, got {list(m.shape)}")
            if m.dtype != torch.float32:
                raise CalibrationError("key-to-query map must be finite float32")
    elif cal.query_map is not None:
        raise CalibrationError("a key-to-query map comes with the mean queries")
    if cal.token_map is not None:
        cal.token_map.validate(cal.layout.num_features)
    check_tensors(cal._tensors())


#: what each calibration tensor's values must be, by the last part of its name (``{kind}.{g}.{part}``) or its
#: whole name: "finite" (added or multiplied into a decode), "spectrum" (eigenvalues: zero or a positive normal
#: float, as the fit writes them), "divisor" (a positive normal float: divided by, or its reciprocal used),
#: "std" (the token map's standard deviations: at least the fit's floor :data:`~kvtc.calibration.token_map.STD_FLOOR`)
_ROLES = {
    "mean": "finite",
    "basis": "finite",
    "eigenvalues": "spectrum",
    "scale": "divisor",
    "queries": "finite",
    "queries.map": "finite",
    "queries.scale": "divisor",
    "tokens.mean": "finite",
    "tokens.std": "std",
    "tokens.probe": "finite",
    "tokens.keys": "finite",
    "tokens.values": "finite",
}
_RULES = {
    "finite": "finite values",
    "spectrum": "eigenvalues that are finite and zero or at least {tiny:.4g} (the smallest normal float)",
    "divisor": "positive finite values of at least {tiny:.4g} (the smallest normal float: a zero, negative or "
    "denormal divisor decodes to inf or NaN)",
    "std": "positive finite standard deviations of at least {floor:.4g} (the fit's floor)",
}
#: the dtype of the tensors that are not float32 (besides the PCA bases: float16)
_DTYPES = {"queries.map": torch.int8, "tokens.keys": torch.int8, "tokens.values": torch.int8}


def _role(name: str) -> str:
    return _ROLES.get(name) or _ROLES.get(name.rsplit(".", 1)[-1], "finite")


def check_tensors(tensors: Mapping[str, torch.Tensor], source: Any = "calibration") -> None:
    """Raise :class:`CalibrationError` (naming the tensor, and saying to rebuild the calibration) unless every
    calibration tensor holds values a decode can use: float32 (the PCA bases float16, the token map's and the
    key-to-query map's weights int8) and finite;
    eigenvalues zero or a positive normal float; feature scales and query logit scales positive normal floats (no
    zero, negative or denormal value: decoding divides by them or by their reciprocals; the token map's column
    scales and the key-to-query map's likewise), the token map's standard
    deviations at least :data:`~kvtc.calibration.token_map.STD_FLOOR`; and, where a PCA group is weighted, its
    coder bases and mean (``basis / scale``, ``basis · scale``, ``mean / scale``) finite.

    One vectorised pass over each tensor (its minimum and maximum, to which a NaN propagates), no copy of it; a
    weighted basis is looked at column by column only when its extremes could overflow the coder's, and values one
    by one only to name the first bad one."""
    widest: dict[str, float] = {}  # the largest |value| of each weighted basis
    for name in sorted(tensors):  # in name order: a file's first bad tensor is named whatever order it was read in
        t = tensors[name]
        basis = name.rpartition(".")[2] == "basis"
        want = torch.float16 if basis else _DTYPES.get(name, torch.float32)
        if not isinstance(t, torch.Tensor) or t.dtype != want:
            got = type(t).__name__ if not isinstance(t, torch.Tensor) else str(t.dtype)
            if basis:
                raise CalibrationError(
                    f"{source}: tensor {printable(name)!r} must be {want}, got {got}: a calibration stores its PCA "
                    f"bases as float16; {_HOSTILE}"
                )
            raise CalibrationError(
                f"{source}: tensor {printable(name)!r} must be {want}, got {got}; the file is corrupt: rebuild "
                "the calibration (`kvtc calibrate`)"
            )
        if t.numel() == 0:
            continue
        role = _role(name)
        lo, hi = (float(x) for x in torch.aminmax(t))
        prefix, _, part = name.rpartition(".")
        if part == "basis" and f"{prefix}.scale" in tensors:
            widest[prefix] = max(hi, -lo)
        # (divisors and standard deviations are float32, their dtype checked above)
        least = -math.inf if role == "finite" else 0.0 if role == "spectrum" else None
        least = (_tiny(t.dtype) if role == "divisor" else _std_floor()) if least is None else least
        # a NaN fails every comparison; -inf fails the finite one
        good = lo >= least and lo > -math.inf and hi < math.inf
        if good and role == "spectrum":
            good = not bool(((t > 0) & (t < _tiny(t.dtype))).any())
        if not good:
            _refuse(source, name, t, role)
    for prefix, top in widest.items():
        basis, scale, mean = tensors[f"{prefix}.basis"], tensors[f"{prefix}.scale"], tensors.get(f"{prefix}.mean")
        if mean is None or basis.dim() != 2 or not mean.shape == scale.shape == basis.shape[1:] or not scale.numel():
            continue  # the shapes are refused by validate
        # every |basis| / scale and |basis| * scale is finite when the extreme ones are (always so for an orthonormal
        # basis, |values| <= 1, and normal scales); else each column is looked at
        low, high = (float(x) for x in torch.aminmax(scale))  # positive normal floats: checked above
        if _overflows(top / low) or _overflows(top * high):
            lo_col, hi_col = torch.aminmax(basis, dim=0)
            column = torch.maximum(hi_col, -lo_col)
            checks = [("basis / scale", column / scale), ("basis * scale", column * scale)]
        else:
            checks = []
        for what, v in [*checks, ("mean / scale", mean / scale)]:
            if not bool(torch.isfinite(v).all()):
                raise CalibrationError(
                    f"{source}: tensors {printable(prefix)!r}.basis/mean/scale: the coder's {what} overflows float32; "
                    "the file is corrupt or was edited: rebuild the calibration (`kvtc calibrate`)"
                )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _overflows(x: float) -> bool:
    """True when ``x`` (a Python float) is beyond float32's range."""
    return not x < float(torch.finfo(torch.float32).max)


def _tiny(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).tiny)


def _std_floor() -> float:
    return float(torch.tensor(STD_FLOOR, dtype=torch.float32))  # as the fit stores it


def _refuse(source: Any, name: str, t: torch.Tensor, role: str) -> None:
    tiny = _tiny(t.dtype)
    ok = torch.isfinite(t)
    if role == "spectrum":
        ok &= (t == 0) | (t >= tiny)
    elif role == "divisor":
        ok &= t >= tiny
    elif role == "std":
        ok &= t >= _std_floor()
    flat = ok.reshape(-1)
    first = int(flat.to(torch.uint8).argmin())
    bad = int((~flat).sum())
    value = float(t.reshape(-1)[first])
    rule = _RULES[role].format(tiny=tiny, floor=STD_FLOOR)
    if name.rpartition(".")[2] == "basis" and t.dtype == torch.float16:
        # a float32 basis entry past float16's range became inf when the calibration rounded it
        rule += " (a PCA basis is orthonormal: its entries lie in [-1, 1], far inside float16's ±65504)"
    what = "token map " if name.startswith("tokens.") else ""
    raise CalibrationError(
        f"{source}: {what}tensor {printable(name)!r} holds {bad} value(s) a decode cannot use (e.g. {value!r} at "
        f"index {first}); it must hold {rule}. The file is corrupt or was edited: rebuild the calibration "
        "(`kvtc calibrate`)"
    )


def shard(cal: Any, heads: tuple[int, ...]) -> Any:
    """The calibration of a tensor-parallel rank holding ``heads``: only possible when every PCA group lies within
    the shard (``PCAGrouping("head_shards", n)``)."""
    layout = cal.layout.shard(heads)
    sub_cols = {c for layer in layout.layers for h in layout.heads for c in cal.layout.pair_columns(layer, h)}
    keep = [g for g, cols in enumerate(cal.columns) if set(cols.tolist()) <= sub_cols]
    if sum(cal.columns[g].numel() for g in keep) != len(sub_cols):
        raise CalibrationMismatch(
            f"heads {heads} cut across this calibration's PCA groups ({cal.grouping.kind}); "
            "calibrate with head_shards grouping matching the tensor-parallel size"
        )
    n = len(keep)
    grouping = PCAGrouping("head_shards", n) if n > 1 else PCAGrouping("global")
    sub = type(cal)(
        layout=layout,
        grouping=grouping,
        pcas={k: [cal.pcas[k][g] for g in keep] for k in KINDS},
        plans={r: {k: [by[k][g] for g in keep] for k in KINDS} for r, by in cal.plans.items()},
        rope=cal.rope,
        model_id=cal.model_id,
        corpus=cal.corpus,
        stats={**cal.stats, "sharded_from": cal.hash},
        library_version=cal.library_version,
        queries=None if cal.queries is None else cal.queries[:, [cal.layout.heads.index(h) for h in heads]],
        query_scales=cal.query_scales,
        query_map=None if cal.query_map is None else cal.query_map[:, [cal.layout.heads.index(h) for h in heads]],
        token_map=None
        if cal.token_map is None
        else cal.token_map.columns(
            torch.tensor([c for li in layout.layers for h in layout.heads for c in cal.layout.pair_columns(li, h)])
        ),
    )
    if [c.tolist() for c in sub.columns] != [_remap(cal.layout, layout, cal.columns[g]) for g in keep]:
        raise CalibrationMismatch("head shard order does not match the calibration's groups")
    return sub


def _remap(full: KVLayout, part: KVLayout, cols: torch.Tensor) -> list[int]:
    """Columns of ``full`` re-expressed in the feature row of ``part``."""
    out = []
    d = full.head_dim
    for c in cols.tolist():
        pair = c // d
        layer = full.layers[pair // len(full.heads)]
        head = full.heads[pair % len(full.heads)]
        out.append(part.pair_columns(layer, head)[c % d])
    return out
