"""Token-adaptive rates: more bits for the middle tokens attention reads, fewer for the rest, at the same bytes.

A plain kvtc blob spends one bit plan on every middle token of a PCA group. Attention is far from uniform: a few
tokens take most of a layer's mass, and an error in a token no query reads costs nothing. A *tiered* blob codes
each group's middle tokens with two of the calibration's plans: the ``share`` of them that attention reads most
with the plan of a higher-quality target (``high``), the others with that of a lower one (``low``), chosen so that
the blob stores what the plain target stores: ``share/high + (1 - share)/low = 1/target``. Below 24x the default
tiers are ``high = target/2`` and ``low = 3·target/2`` (a share of a quarter). Where the plain target is lossy
(its plan's predicted relative error at least ``LOSSY_ERROR``: Gemma-3-270M from 24x, SmolLM2-135M not up to 64x;
without that figure, from 24x) concentrating the bits pays: the high tier is no coarser than 12x (or a quarter of the target, if
coarser), the low tier costs almost nothing (six times the target, at most 192x, the ladder's cheapest plan): 24x
codes 12x/144x, 32x 12x/192x, 48x 12x/192x, 64x 16x/192x. Measured on text the eval does not read
(docs/studies/tier-pairs.md): against halving and tripling the target, 3-7% lower
next-token KL at 24x and 32x, 25% at 48x, 11% at 64x on Gemma-3-270M; below 24x there, and at 24x to 64x on
SmolLM2-135M, a cheap low tier does worse (SmolLM2 32x: 12x/192x twice the KL of 16x/48x). Calibrations without
those plans fall back to ``target/2`` and ``3·target``, then ``target/2`` and ``3·target/2``.

Which tokens attention reads is estimated from what the encoder holds (:mod:`kvtc.codec.attention`). The decoder
does not rank anything: the blob carries each group's choice as a bit mask (section ``tiers.{g}``, docs/FORMAT.md),
so decoding never depends on the queries.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..errors import CalibrationError, FormatError

#: the tiers' targets as multiples of the blob's target (the share of high-tier tokens follows, see :func:`share`)
HIGH_FACTOR = 0.5
LOW_FACTOR = 1.5
#: from this target on, concentrated tiers: the high one at ``max(WIDE_HIGH, target·WIDE_HIGH_FACTOR)``, the low one
#: at ``min(target·WIDE_LOW_FACTOR, WIDE_LOW_CAP)``; recipe r13's (half, three times) is their first fallback
WIDE_FROM = 24.0
#: ... or, where the calibration predicts its plans' error, from the target whose one-plan error (the largest
#: predicted relative error over kinds and PCA groups) reaches this: Gemma-3-270M's 24x (0.096; 16x: 0.047), while
#: SmolLM2-135M, whose 64x predicts 0.051, keeps half and 1.5 times, which measured best there at 24x to 64x
LOSSY_ERROR = 0.07
WIDE_HIGH = 12.0
WIDE_HIGH_FACTOR = 0.25
WIDE_LOW_FACTOR = 6.0
WIDE_LOW_CAP = 192.0
R13_LOW_FACTOR = 3.0
#: rate ladder (container version 4): a blob of target ``t`` codes each token of a group with one of the
#: calibration's plans from ``t / LADDER_SPAN`` to ``t · LADDER_SPAN`` (rungs at least ``LADDER_STEP`` apart), the
#: one minimising its weighted error plus a price per byte (:func:`allocate`); weights: attention mass ** power
LADDER_SPAN = 8.0
LADDER_STEP = 1.2
MAX_RUNGS = 16
LADDER_POWER = 2.0
#: bits per token and (kind, group) the rung indices are assumed to store (entropy coded: 2.8-4.3 measured on
#: Gemma-3-270M), kept out of the budget
INDEX_BITS = 4.0
#: share of the budget kept back for the header (about 1.2% of a Gemma-3-270M blob at 64x; the positions, delta
#: coded, take a few dozen bytes) and the rungs' rows storing more than their plans' calibration rows do (the finer
#: rungs get the tokens with the larger coefficients: the measured size then lowers the price, ladder.allocate)
LADDER_HEADROOM = 0.015
#: what a value's error counts for against a key's when one price spans kinds and groups, each kind's error taken
#: over its energy (measured on text the eval does not read, docs/studies/rate-ladder.md, "each kind's units":
#: against the calibration's value weight of 2, 4-15% lower next-token KL at 11 of 12 points of both models). The
#: rows of a whole blob share one price (docs/studies/rate-ladder.md, "one price"); a rung's error is spread over a
#: group's layers by the diagonal rule (docs/studies/ladder-errors.md)
LADDER_VALUE_WEIGHT = 1.0
#: encodes of a group's rows at most: after each, the coded size is measured and the budget scaled if it is over
LADDER_PASSES = 3


def tier_targets(target: float, plain_error: float | None = None) -> tuple[float, float]:
    """(high, low) targets of the default tiers of ``target``; ``plain_error``: the calibration's predicted relative
    error of the target's one plan (None: decide by the target alone, ``WIDE_FROM``)."""
    if not concentrated(target, plain_error):
        return target * HIGH_FACTOR, target * LOW_FACTOR
    return max(WIDE_HIGH, target * WIDE_HIGH_FACTOR), min(target * WIDE_LOW_FACTOR, WIDE_LOW_CAP)


def concentrated(target: float, plain_error: float | None = None) -> bool:
    """Whether ``target``'s one plan is lossy enough for concentrated tiers (see ``LOSSY_ERROR``)."""
    return target >= WIDE_FROM if plain_error is None else plain_error >= LOSSY_ERROR


def tier_candidates(target: float, plain_error: float | None = None) -> list[tuple[float, float]]:
    """The (high, low) pairs ``tiers="auto"`` tries for ``target``, best first: the default tiers, then (where
    those concentrate) recipe r13's half and three times the target, then half and 1.5 times; only pairs that
    bracket the target. ``plain_error`` as for :func:`tier_targets`."""
    wide = concentrated(target, plain_error)
    pairs = [tier_targets(target, plain_error), (target * HIGH_FACTOR, target * R13_LOW_FACTOR)] if wide else []
    pairs.append((target * HIGH_FACTOR, target * LOW_FACTOR))
    return [p for p in dict.fromkeys(pairs) if p[0] < target < p[1]]


def plain_error(cal: Any, target: float) -> float | None:
    """The calibration's predicted relative error of ``target``'s one plan, the largest over kinds and PCA groups
    (``Calibration.stats["predicted_relative_error"]``, written by the fit), or None where it is not recorded or
    not numbers (the stats come from the file; a wrong figure can only change which recorded plans code a blob)."""
    from ..calibration.artifact import ratio_key

    pe = (cal.stats or {}).get("predicted_relative_error", {})
    pe = pe.get(ratio_key(target)) if isinstance(pe, dict) else None
    try:
        vals = [float(x) for v in pe.values() for x in v] if isinstance(pe, dict) else []
    except (TypeError, ValueError):
        return None
    return max(vals) if vals else None


def auto_pair(cal: Any, target: float) -> tuple[float, float] | None:
    """The (high, low) targets ``tiers="auto"`` codes ``target`` with under calibration ``cal``: the first of
    :func:`tier_candidates` whose plans ``cal`` has, or None (no queries recorded, or no such pair: one plan)."""
    from ..calibration.artifact import ratio_key

    if cal.queries is None:
        return None
    pairs = tier_candidates(target, plain_error(cal, target))
    return next((p for p in pairs if all(ratio_key(r) in cal.plans for r in p)), None)


def share(target: float, high: float, low: float) -> float:
    """The share of tokens coded at ``high`` so that the blob stores what ``target`` stores."""
    if not high < target < low:
        raise ValueError(f"tier targets must bracket the target: {high} < {target} < {low}")
    return (1 / target - 1 / low) / (1 / high - 1 / low)


def high_count(middle: int, frac: float) -> int:
    """High-tier tokens of a sequence with ``middle`` coded tokens of a group."""
    return min(middle, max(0, int(middle * frac + 0.5)))


def ladder_rungs(cal: Any, target: float) -> tuple[str, ...] | None:
    """The rungs (ratio keys, finest first) a rate-ladder blob of ``target`` chooses among under calibration ``cal``:
    its plans from ``target / LADDER_SPAN`` to ``target · LADDER_SPAN``, skipping any within ``LADDER_STEP`` of the
    previous rung kept (at most ``MAX_RUNGS``); None where the calibration records no queries or fewer than two rungs
    bracket the target (one plan then codes every token)."""
    from ..calibration.artifact import ratio_key

    if cal.queries is None:
        return None
    kept: list[float] = []
    for r in sorted(float(x) for x in cal.plans):
        if target / LADDER_SPAN <= r <= target * LADDER_SPAN and (not kept or r >= kept[-1] * LADDER_STEP):
            kept.append(r)
    if len(kept) > MAX_RUNGS or not any(r < target for r in kept) or not any(r > target for r in kept):
        return None
    return tuple(ratio_key(r) for r in kept)


def kind_cost(cal: Any, ratio: float | str, kind: str, group: int) -> float:
    """The bytes a token of PCA group ``group`` stores in ``kind`` under the plan of ``ratio``, as a fraction of its
    16-bit bytes of that kind: ``1/ratio`` of both kinds together, split as the calibration split the bits between
    keys and values (``stats["kv_split"]["value_share"]``; an even split where it records none)."""
    from ..calibration.artifact import ratio_key

    split = (cal.stats or {}).get("kv_split", {})
    shares = split.get("value_share", {}) if isinstance(split, dict) else {}
    share = shares.get(ratio_key(float(ratio))) if isinstance(shares, dict) else None
    try:
        v = float(share[group]) if isinstance(share, list) else float(share)
    except (TypeError, ValueError, IndexError):
        v = 0.5
    if not 0.0 < v < 1.0:
        v = 0.5
    return 2.0 * (v if kind == "values" else 1.0 - v) / float(ratio)


def kind_weight(cal: Any, kind: str, group: int) -> float:
    """What a unit of ``kind``'s weighted squared error in PCA group ``group`` counts for under the blob's one price:
    the error over the kind's energy (its PCA's total variance), values times :data:`LADDER_VALUE_WEIGHT` (1 where
    the energy is not a positive number)."""
    try:
        energy = float(cal.pcas[kind][group].total_variance)
    except (TypeError, ValueError):
        return 1.0
    if not (math.isfinite(energy) and energy > 0):
        return 1.0
    return (LADDER_VALUE_WEIGHT if kind == "values" else 1.0) / energy


def layer_of(columns: torch.Tensor, per_layer: int) -> torch.Tensor:
    """int64 ``[columns]``: the position in :func:`group_layers` of the layer each of a group's feature columns
    belongs to."""
    layer = columns.cpu() // per_layer
    return torch.searchsorted(torch.unique(layer), layer)


def layer_spread(cal: Any, kind: str, group: int, components: int, per_layer: int) -> torch.Tensor:
    """float32 ``[components, Lg]``: the share of each of the group's first basis rows (the calibration's weighted
    space, unit rows) in each of its layers, in the order of :func:`group_layers`; cached on the calibration."""
    cache = cal.__dict__.setdefault("_layer_spread", {})
    key = (kind, group, per_layer)
    if key not in cache or cache[key].shape[0] < components:
        idx = layer_of(cal.columns[group], per_layer)
        basis = cal.pcas[kind][group].basis.float()
        spread = torch.zeros((basis.shape[0], int(idx.max()) + 1), dtype=torch.float32)
        spread.index_add_(1, idx, basis.square())
        cache[key] = spread
    return cache[key][:components]


def ladder_weights(mass: torch.Tensor, power: float = LADDER_POWER) -> torch.Tensor:
    """float32 ``[B·m, Lg]``: the weight of each middle token's error in each of a group's ``Lg`` layers, from the
    attention ``mass`` ``[B, Lg, m]`` it receives there: its mass over the layer's mean in its sequence, raised to
    ``power`` (an error in a token costs next-token loss about in proportion to the square of the attention it gets:
    docs/studies/rate-ladder.md)."""
    m = mass.double()
    w = (m / m.mean(2, keepdim=True).clamp_min(1e-30)) ** power
    return w.permute(0, 2, 1).reshape(-1, mass.shape[1]).float()


def allocate(errors: torch.Tensor, costs: torch.Tensor, budget: float) -> torch.Tensor:
    """int64 ``[N]``: the rung of each token minimising ``Σ errors[i, rung] + λ·Σ costs[i, rung]`` for the smallest
    ``λ ≥ 0`` whose choice costs at most ``budget`` (``errors`` ``[N, R]``, ``costs`` ``[R]`` or ``[N, R]``; if even
    the cheapest rung everywhere costs more, that). Bisection on ``λ`` (each token's best rung is monotone in it):
    the choice is optimal for its own cost (no other choice of at most that cost has a smaller summed error, up to
    ties)."""
    n = errors.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=errors.device)
    e = errors.double()
    c = costs.double().to(e.device).expand_as(e)

    def pick(lam: float) -> torch.Tensor:
        return torch.argmin(e + lam * c, dim=1)

    def spent(choice: torch.Tensor) -> float:
        return float(c.gather(1, choice[:, None]).sum())

    best = pick(0.0)
    if spent(best) <= budget:
        return best
    lo, hi = 0.0, 1.0
    while spent(pick(hi)) > budget:
        hi *= 4.0
        if hi > 1e300:
            return torch.argmin(c, dim=1)
    for _ in range(64):
        mid = (lo + hi) / 2
        if spent(pick(mid)) > budget:
            lo = mid
        else:
            hi = mid
    return pick(hi)


def group_layers(columns: torch.Tensor, layout: Any) -> list[int]:
    """Positions (in ``layout.layers``) of the layers a PCA group's feature columns belong to."""
    per_layer = len(layout.heads) * layout.head_dim
    return sorted(set((columns // per_layer).tolist()))


def choose(mass: torch.Tensor, layers: list[int], start: int, middle: int, frac: float) -> torch.Tensor:
    """bool ``[B·middle]`` (rows in the codec's ``(sequence, token)`` order): the ``high_count`` tokens of each
    sequence's ``[start, start + middle)`` that the group's ``layers`` attend to most (ties: the older token)."""
    B = mass.shape[0]
    score = mass[:, layers, start : start + middle].sum(1)  # [B, m]
    k = high_count(middle, frac)
    chosen = torch.zeros((B, middle), dtype=torch.bool, device=mass.device)
    if k:
        order = torch.argsort(-score, dim=1, stable=True)
        chosen.scatter_(1, order[:, :k], True)
    return chosen.reshape(-1)


def mask_bytes(batch: int, middle: int) -> int:
    """Raw bytes of one group's mask section."""
    return (batch * middle + 7) // 8


def pack_mask(mask: torch.Tensor) -> bytes:
    """A bool mask as bits, least significant first, zero padding."""
    return np.packbits(mask.cpu().numpy().astype(np.uint8), bitorder="little").tobytes()


def unpack_mask(data: Any, batch: int, middle: int, frac: float, name: str) -> torch.Tensor:
    """The mask a ``tiers.{g}`` section holds, checked: exactly ``high_count`` high tokens in every sequence and zero
    padding (else :class:`~kvtc.errors.FormatError`: the section sizes that follow depend on these counts)."""
    if isinstance(data, torch.Tensor):  # decoded on a device
        data = data.cpu().numpy().tobytes()
    raw = np.frombuffer(bytes(data), dtype=np.uint8)
    if raw.size != mask_bytes(batch, middle):
        raise FormatError(f"section {name}: {raw.size} bytes, {mask_bytes(batch, middle)} expected")
    bits = np.unpackbits(raw, bitorder="little")
    n = batch * middle
    if bits[n:].any():
        raise FormatError(f"section {name}: padding bits set; the blob is corrupt")
    mask = torch.from_numpy(bits[:n].astype(bool))
    k = high_count(middle, frac)
    if batch and not bool((mask.view(batch, middle).sum(1) == k).all()):
        raise FormatError(f"section {name}: a sequence marks other than {k} high-tier tokens; the blob is corrupt")
    return mask


def unpack_rungs(data: Any, counts: list[int], name: str) -> torch.Tensor:
    """int64 ``[n]``: the rung of each row a ``rungs.{kind}.{g}`` section holds, checked: a byte per row, each below
    the number of rungs, each rung as often as the header counts (else :class:`~kvtc.errors.FormatError`: the
    sections that follow are sized by those counts)."""
    if isinstance(data, torch.Tensor):  # decoded on a device
        data = data.cpu().numpy().tobytes()
    raw = np.frombuffer(bytes(data), dtype=np.uint8)
    if raw.size != sum(counts):
        raise FormatError(f"section {name}: {raw.size} rows, the header counts {sum(counts)}; the blob is corrupt")
    if raw.size and int(raw.max()) >= len(counts):
        raise FormatError(f"section {name}: a rung index above the {len(counts)} rungs; the blob is corrupt")
    idx = torch.from_numpy(raw.astype(np.int64))
    if torch.bincount(idx, minlength=len(counts)).tolist() != list(counts):
        raise FormatError(f"section {name}: rung counts differ from the header's; the blob is corrupt")
    return idx


def resolve(cal: Any, ratio: float, asked: Any) -> tuple[tuple[str, str, float] | None, tuple[str, ...] | None]:
    """``((high, low, share), None)`` for a two-tier encode, ``(None, rungs)`` for a rate ladder, ``(None, None)``
    for one plan: what a codec of ``cal`` at ``ratio`` asked for ``asked`` tiers codes with."""
    from ..calibration.artifact import ratio_key

    if asked == "none":
        return None, None
    if asked == "auto":
        rungs = ladder_rungs(cal, ratio)
        if rungs is not None:
            return None, rungs
        asked = "two"  # a calibration whose ladder does not bracket the target: two tiers where it has them
    if asked == "two":
        pair = auto_pair(cal, ratio)
        if pair is None:
            return None, None
        high, low = pair
    else:  # an explicit pair (the decode-memory benchmark and tests pin their tiers this way)
        try:
            high, low = (float(x) for x in asked)
        except (TypeError, ValueError):
            raise ValueError(f"tiers must be 'auto', 'two', 'none' or (high, low) targets, got {asked!r}") from None
        if cal.queries is None:
            raise CalibrationError(
                "token-adaptive tiers need a calibration that records queries (`kvtc calibrate` with the default "
                "recipe); this one does not"
            )
        for r in (high, low):
            cal.plans_for(r)  # raises, naming the ratios it has
        if not high < ratio < low:
            raise ValueError(f"tier targets must bracket the target: {high:g} < {ratio:g} < {low:g}")
    return (ratio_key(high), ratio_key(low), round(share(ratio, high, low), 6)), None


__all__ = [
    "resolve",
    "HIGH_FACTOR",
    "LOW_FACTOR",
    "INDEX_BITS",
    "LADDER_HEADROOM",
    "LADDER_PASSES",
    "LADDER_POWER",
    "LADDER_SPAN",
    "LADDER_VALUE_WEIGHT",
    "LADDER_STEP",
    "LOSSY_ERROR",
    "MAX_RUNGS",
    "allocate",
    "kind_cost",
    "kind_weight",
    "ladder_rungs",
    "ladder_weights",
    "layer_of",
    "layer_spread",
    "auto_pair",
    "concentrated",
    "choose",
    "group_layers",
    "high_count",
    "mask_bytes",
    "pack_mask",
    "plain_error",
    "R13_LOW_FACTOR",
    "WIDE_FROM",
    "WIDE_HIGH",
    "WIDE_HIGH_FACTOR",
    "WIDE_LOW_CAP",
    "WIDE_LOW_FACTOR",
    "share",
    "tier_candidates",
    "tier_targets",
    "unpack_mask",
    "unpack_rungs",
]
