"""The rate ladder's codec side (container version 4): choose each row's rung, code every rung's rows, size them.

:mod:`kvtc.codec.tiers` holds the ladder's rules (which rungs a target uses, the attention weights, the rows'
allocation at one price, each kind's units); this module applies them to a slice a :class:`~kvtc.codec.Codec`
encodes, and tells the decoder where each rung's rows lie in the merged sections.

Encode (:func:`encode`): each kind and PCA group's rows are projected once on the widest rung's components; each
row's error under every rung's plan is measured (per layer, in the calibration's weighted space, times the attention
its token receives there, :func:`errors`), in the units :func:`kvtc.codec.tiers.kind_weight` gives; the rows of the
whole blob share one price and are allocated together (:func:`allocate`) so that they store what the target's plans store for them, the coded size
measured on the CPU and the price raised where it is over. Sections, per kind and group: ``rungs.{kind}.{g}`` (a
byte per middle token), then ``{kind}.{g}.params`` and ``{kind}.{g}.{type}``, each holding every rung's rows, rung
after rung (the header's ``rung_counts`` size each part: :func:`pieces`).

``codec`` is the :class:`~kvtc.codec.Codec` that calls this module; :mod:`kvtc.codec.codec` imports this one, so it
is typed ``Any`` here (no import back).
"""

from __future__ import annotations

from typing import Any

import torch

from ..calibration.artifact import KINDS
from ..coding.clock import Clock
from ..coding.entropy import Modeled, Precoded, encode_stream
from ..coding.quantizer import CODED_TYPES, PlanLayout, Quantizer, plan_layouts
from ..errors import FormatError
from . import container, tiers

#: one kind and group's rows waiting for their rungs: (group, kind, coefficients ``[n, kmax]``, rung layouts,
#: float64 errors ``[n, rungs]``, float64 bytes of a row under each rung ``[rungs]``, goal in bytes)
Unit = tuple[int, str, torch.Tensor, list[PlanLayout], torch.Tensor, torch.Tensor, float]


def encode(
    codec: Any,
    group_rows: dict[str, list[torch.Tensor | None]],
    middles: list[tuple[int, int]],
    mass: torch.Tensor,
    header: container.Header,
    clock: Clock,
    reserve: float = 0.0,
) -> list[tuple[str, Any]]:
    """Sections of each kind and PCA group of a rate-ladder blob (kind-major, as a plain blob orders them): the
    rung of each row (``rungs.{kind}.{g}``), chosen by :func:`kvtc.codec.tiers.allocate` from each row's error
    under every rung's plan (per layer, weighted by the attention its token receives there), then the rows of
    every rung, in token order, coded by its plan: the rungs' sections of one name back to back as one section
    (``{kind}.{g}.params``, ``{kind}.{g}.{type}``). The rows share one price (one for the whole blob, so that all its
    rows store what the target's plans store for them), each kind's error in the units :func:`kvtc.codec.tiers.kind_weight` gives. ``group_rows``: each kind's rows
    ``[n, features]`` per group (None: the group codes no token); ``mass``: ``[B, L, T]`` attention each token
    receives; ``reserve``: bytes the blob stores beyond what the plans' budgets count (a version-5 blob's token ids),
    taken from every group's goal in proportion. Fills ``header.rung_counts``."""
    cal = codec.calibration
    assert cal is not None and codec.ladder is not None and header.rung_counts is not None
    layouts = [plan_layouts(cal, r) for r in codec.ladder]
    target = float(codec.ratio)  # type: ignore[arg-type]
    per_layer = len(header.layout.heads) * header.layout.head_dim
    todo: list[Unit] = []
    for g in range(len(middles)):
        cols = cal.columns[g]
        for kind in KINDS:
            rows = group_rows[kind][g]
            if rows is None:
                continue
            x = rows if len(cal.columns) == 1 else rows[:, cols.to(rows.device)]
            pls = [lay[kind][g] for lay in layouts]
            with clock("project"):
                coeffs = codec._transform.project(kind, g, x, max(pl.components for pl in pls))  # type: ignore[union-attr]
            with clock("tiers"):
                errs, costs = errors(codec, kind, g, coeffs, pls, mass, middles[g], header, per_layer)
            errs = errs * tiers.kind_weight(cal, kind, g)
            # bytes: what the target's own plan stores for these rows, less the headroom; a row under each rung
            bf16 = 2 * cols.numel()
            goal = coeffs.shape[0] * tiers.kind_cost(cal, target, kind, g) * bf16 * (1 - tiers.LADDER_HEADROOM)
            todo.append((g, kind, coeffs, pls, errs, costs * bf16, goal))
    total = sum(t[6] for t in todo)
    if reserve and total > 0:  # the blob's other sections count against the same target
        todo = [(*t[:6], t[6] * max(0.0, 1 - reserve / total)) for t in todo]
    done: dict[tuple[int, str], tuple[torch.Tensor, list[tuple[str, Any]]]] = {}
    if todo:
        done.update(allocate(codec, todo, clock))
    out: list[tuple[str, Any]] = []
    for kind in KINDS:
        for g in range(len(middles)):
            if (g, kind) not in done:  # the group codes no token
                header.rung_counts[kind].append([0] * len(codec.ladder))
                continue
            idx, sections = done[(g, kind)]
            header.rung_counts[kind].append(torch.bincount(idx, minlength=len(codec.ladder)).tolist())
            out.extend(sections)
    return out


def allocate(
    codec: Any, todo: list[Unit], clock: Clock
) -> dict[tuple[int, str], tuple[torch.Tensor, list[tuple[str, Any]]]]:
    """``{(group, kind): (rungs, sections)}`` of the kinds and groups in ``todo`` (:data:`Unit`), at one price:
    their rows store their goals together, the rung indices (:data:`kvtc.codec.tiers.INDEX_BITS`) included; on the
    CPU the coded size is measured and the price raised if it is over, at most
    :data:`kvtc.codec.tiers.LADDER_PASSES` encodes."""
    sizes = [t[2].shape[0] for t in todo]
    errs = torch.cat([t[4] for t in todo])
    costs = torch.cat([t[5].expand(n, -1) for t, n in zip(todo, sizes)])
    goal = sum(t[6] for t in todo)
    budget = goal - sum(sizes) * tiers.INDEX_BITS / 8.0
    floor = float(costs.min(1).values.sum())
    done: dict[tuple[int, str], tuple[torch.Tensor, list[tuple[str, Any]]]] = {}
    for attempt in range(tiers.LADDER_PASSES):
        with clock("tiers"):
            idx = tiers.allocate(errs, costs, max(budget, floor))
        done = {}
        for (g, kind, coeffs, pls, *_), part in zip(todo, idx.split(sizes)):
            done[(g, kind)] = (part, sections(codec, kind, g, coeffs, part, pls, clock))
        coded = {key: measured(codec, secs, clock) for key, (_, secs) in done.items()}
        if any(c is None for c in coded.values()):
            break
        size = sum(len(c.coded) if c.backend != "raw" else c.raw_len for cs in coded.values() for _, c in cs)  # type: ignore[union-attr]
        if size <= goal or attempt == tiers.LADDER_PASSES - 1:
            done = {key: (done[key][0], cs) for key, cs in coded.items()}  # type: ignore[misc]
            break
        budget *= goal / size  # the rows stored more than their plans predict: ask for less
    return done


def sections(
    codec: Any, kind: str, g: int, coeffs: torch.Tensor, idx: torch.Tensor, pls: list[PlanLayout], clock: Clock
) -> list[tuple[str, Any]]:
    """Group ``g``'s sections for the rungs ``idx`` (int64 ``[n]`` CPU): the indices, then each name's rung
    sections back to back."""
    out: list[tuple[str, Any]] = [(f"rungs.{kind}.{g}", idx.to(torch.uint8).numpy().tobytes())]
    idx = idx.to(coeffs.device)
    merged: dict[str, list[Any]] = {}
    for j, pl in enumerate(pls):
        sel = idx == j
        if bool(sel.any()):
            part = coeffs[sel][:, : pl.components].contiguous()
            for name, data in codec._quantizer.encode(f"{kind}.{g}.r{j}", part, pl, codec.packing, clock):
                merged.setdefault(name.rsplit(".", 1)[1], []).append(data)
    out.extend((f"{kind}.{g}.{suffix}", _joined(merged[suffix])) for suffix in _suffixes(merged))
    return out


def measured(codec: Any, secs: list[tuple[str, Any]], clock: Clock) -> list[tuple[str, Precoded]] | None:
    """Host sections entropy coded now (their stored size), or None for device ones (the GPU's coder codes
    them with the rest of the blob)."""
    if any(isinstance(d, torch.Tensor) for _, d in secs):
        return None
    out = []
    with clock("entropy"):
        for name, data in secs:
            used, coded = encode_stream(data, codec.backend)
            out.append((name, Precoded(used, coded, len(data), lambda d=data: bytes(d))))
    return out


def errors(
    codec: Any,
    kind: str,
    g: int,
    coeffs: torch.Tensor,
    pls: list[PlanLayout],
    mass: torch.Tensor,
    middle: tuple[int, int],
    header: container.Header,
    per_layer: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[n, rungs]`` CPU: the error of each of group ``g``'s rows (``coeffs`` ``[n, kmax]``) under each
    rung's plan, per layer in the calibration's weighted space times the attention weight of the token there
    (:func:`kvtc.codec.tiers.ladder_weights`); and float64 ``[rungs]``: what a token costs under each."""
    cal = codec.calibration
    assert cal is not None and codec.ladder is not None
    cols = cal.columns[g]
    layers = tiers.group_layers(cols, header.layout)
    start, m = middle
    weights = tiers.ladder_weights(mass[:, layers, start : start + m]).to(coeffs.device)  # [n, Lg]
    c = coeffs.float()
    spread = tiers.layer_spread(cal, kind, g, c.shape[1], per_layer).to(c.device)  # [kmax, Lg]
    errs = []
    for pl in pls:
        diff = -c
        diff[:, : pl.components] += Quantizer.dequantized(c[:, : pl.components], pl)
        per = diff.square() @ spread  # each component's error spread over the layers as its basis row is
        errs.append((per * weights).sum(1))
    costs = torch.tensor([tiers.kind_cost(cal, r, kind, g) for r in codec.ladder], dtype=torch.float64)
    return torch.stack(errs, 1).double().cpu(), costs


# ------------------------------------------------------------------ decode side: where each rung's rows lie
def pieces(cal: Any, h: container.Header, kind: str, g: int) -> dict[str, list[tuple[str, int]]]:
    """A rate-ladder group's merged sections (by suffix, blob order) and the ``(rung section, raw bytes)`` each
    holds back to back, from the header's counts."""
    assert h.rungs is not None and h.rung_counts is not None
    merged: dict[str, list[tuple[str, int]]] = {}
    for j, n in enumerate(h.rung_counts[kind][g]):
        if n:
            pl = plan_layouts(cal, h.rungs[j])[kind][g]
            for name, size in pl.section_sizes(f"{kind}.{g}.r{j}", n, h.packing).items():
                merged.setdefault(name.rsplit(".", 1)[1], []).append((name, size))
    return {x: merged[x] for x in _suffixes(merged)}  # type: ignore[arg-type]


def expected(
    cal: Any,
    h: container.Header,
    middles: list[tuple[int, int]],
    exp: dict[str, int],
    hints: dict[str, Any] | None = None,
) -> dict[str, int]:
    """``exp`` (the sections every blob has, name -> raw bytes) plus a rate-ladder blob's own, after checking its
    rung counts against the groups (:class:`~kvtc.errors.FormatError` where they disagree); ``hints`` receives
    each fixed-step plane's ``gauss`` model (:class:`kvtc.coding.gaussian.Hint`, every rung's rows in turn)."""
    assert h.rungs is not None and h.rung_counts is not None
    for kind in KINDS:
        counts = h.rung_counts[kind]
        if len(counts) != len(middles):
            raise FormatError(f"blob counts rungs of {len(counts)} PCA groups, its calibration has {len(middles)}")
        for g, (_, m) in enumerate(middles):
            if sum(counts[g]) != h.batch * m:
                raise FormatError(
                    f"blob's rung counts of {kind} group {g} sum to {sum(counts[g])}, it codes {h.batch * m} "
                    "tokens there; the blob is corrupt"
                )
            if not m:
                continue
            exp[f"rungs.{kind}.{g}"] = h.batch * m
            for suffix, parts in pieces(cal, h, kind, g).items():
                exp[f"{kind}.{g}.{suffix}"] = sum(size for _, size in parts)
            if hints is not None:
                for j, n in enumerate(h.rung_counts[kind][g]):
                    for suffix, hint in plan_layouts(cal, h.rungs[j])[kind][g].hints(n, h.packing).items():
                        name = f"{kind}.{g}.{suffix}"
                        hints[name] = hints[name] + hint if name in hints else hint
    return exp


def _suffixes(merged: dict[str, list[Any]]) -> list[str]:
    """The section suffixes of a rate-ladder group in blob order: ``params``, then the types in
    :data:`CODED_TYPES` order."""
    from ..quant import TYPE_NAMES

    order = ["params"] + [TYPE_NAMES[t] for t in CODED_TYPES]
    return [x for x in order if x in merged]


def _joined(parts: list[Any]) -> Any:
    """Sections' payloads back to back: one device tensor if they are tensors, else bytes (:class:`Modeled`
    bytes, their hints joined, if every part is)."""
    if any(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])
    data = b"".join(bytes(p) for p in parts)
    if parts and all(isinstance(p, Modeled) for p in parts):
        hint = parts[0].hint
        for p in parts[1:]:
            hint = hint + p.hint
        return Modeled(data, hint)
    return data


__all__ = ["Unit", "allocate", "encode", "errors", "expected", "measured", "pieces", "sections"]
