"""Checks and derivations of a :class:`~kvtc.calibration.artifact.Calibration` kept beside it: the validation of
every tensor and plan against the layout and grouping, and the cut of a tensor-parallel rank's shard."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import CalibrationError, CalibrationMismatch
from ..layout import KVLayout, PCAGrouping

if TYPE_CHECKING:
    from .artifact import Calibration

KINDS = ("keys", "values")


def validate(cal: Calibration) -> None:
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
                if t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
                    raise CalibrationError(f"{kind} group {g}: {name} must be finite float32")
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
            if t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
                raise CalibrationError(f"{name} must be finite float32")
        if not bool((sc > 0).all()):
            raise CalibrationError("query logit scales must be positive")
        m = cal.query_map
        if m is not None:
            want = (len(lay.layers), len(lay.heads), lay.head_dim + 1, q.shape[2] * lay.head_dim)
            if tuple(m.shape) != want:
                raise CalibrationError(f"key-to-query map must be {list(want)}, got {list(m.shape)}")
            if m.dtype != torch.float32 or not bool(torch.isfinite(m).all()):
                raise CalibrationError("key-to-query map must be finite float32")
    elif cal.query_map is not None:
        raise CalibrationError("a key-to-query map comes with the mean queries")
    if cal.token_map is not None:
        cal.token_map.validate(cal.layout.num_features)


def shard(cal: Calibration, heads: tuple[int, ...]) -> Calibration:
    """The calibration of a tensor-parallel rank holding ``heads``: only possible when every PCA group lies within
    the shard (``PCAGrouping("head_shards", n)``)."""
    from .artifact import Calibration

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
    sub = Calibration(
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
