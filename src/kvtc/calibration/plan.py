"""The plan space of the bit allocation, and the plan it chooses (KVTC §3, ALGORITHM.md step 5).

A :class:`Plan` cuts one PCA group's components, in order, into groups of a size from ``DEFAULT_SIZES`` and a
quantization type from ``DEFAULT_TYPES`` (:mod:`kvtc.quant`); :mod:`kvtc.calibration.dp` finds the one of least
measured error under a bit budget. This module holds what both the allocator and the codec need: the sets of
sizes and types, the fixed-step ladder (ours) and its DP candidate codes, and the plan with its validated
serialization (calibration files carry plans; a malformed one is refused with a typed error).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CalibrationError
from ..quant import (
    DROP,
    FIXED_TYPES,
    FP8,
    FP8S,
    INT1S,
    INT2,
    INT2F,
    INT2S,
    INT3,
    INT3S,
    INT4,
    INT4F,
    INT4S,
    INT8F,
    TYPE_NAMES,
    clippable,
    group_bits,
)

#: the paper's group sizes and quantization types
DEFAULT_SIZES: tuple[int, ...] = (1, 16, 64, 256, 1024)
PAPER_TYPES: tuple[int, ...] = (INT2, INT4, FP8)
#: the default adds int3 and the scale-only types (ours): on SmolLM2 the DP's measured error at the same
#: bits falls by about a fifth at 7-8x (docs/studies/quant-types.md)
#: and the 1-bit int1s: with the coded rate it lowers next-token KL by a further 5-11% at 16x on both embedded
#: models (docs/studies/coded-rate.md)
#: (the r9 recipe's set) and the fixed-step int2f / int4f / int8f: no per-token range parameters, each component's
#: step chosen from a ladder (docs/studies/fixed-types.md; docs/studies/history.md, r10 against r9)
R9_TYPES: tuple[int, ...] = (INT2, INT3, INT4, FP8, INT2S, INT3S, INT4S, FP8S, INT1S)
DEFAULT_TYPES: tuple[int, ...] = R9_TYPES + (INT2F, INT4F, INT8F)
#: fixed-step candidates (ours): each component may take any step of a ladder ``top · 2^(-r/2)``, r < FIXED_RUNGS,
#: ``top`` the largest standard deviation among the rows' components (rounded to float32)
FIXED_RUNGS = 24
#: the range of a fixed-step group's step: a normal float32 (a zero or denormal step divides the encoder's
#: coefficients to infinity) whose largest code (``FIXED_HALF`` + 1 steps) stays finite in float32
MIN_STEP = 2.0**-126
MAX_STEP = 2.0**120
#: candidate keys of fixed-step rungs: (1, _VIRTUAL + type * FIXED_RUNGS + rung); a plan stores the real type
_VIRTUAL = 1 << 10


def real_type(code: int) -> int:
    """The quantization type of a DP candidate code (a fixed-step rung's code names its type)."""
    return (code - _VIRTUAL) // FIXED_RUNGS if code >= _VIRTUAL else code


def fixed_ladder(coeffs: torch.Tensor) -> torch.Tensor:
    """The fixed-step candidates' steps for these ``[rows, k]`` coefficients: float32 ``[FIXED_RUNGS]``."""
    top = float(coeffs.float().std(0).max()) if coeffs.shape[0] > 1 else float(coeffs.abs().max())
    top = max(top, 1e-30)
    return (top * 2.0 ** (-torch.arange(FIXED_RUNGS, dtype=torch.float64) / 2)).float()


@dataclass(frozen=True)
class Plan:
    """A bit plan for one PCA group: run-length ``segments`` of ``(size, type, repeat)`` in component order.

    The segments cover components ``[0, num_components)``; every component past them is dropped.

    ``predicted_error`` is the DP's summed squared error on its ``rows`` calibration rows (PCA space,
    components beyond the basis excluded).

    ``clips`` (ours): the encoder's clip of each *kept* group in component order (see :mod:`kvtc.quant`; below 1
    only for scale-only int groups of more than one component), or a fixed-step group's step (any positive
    float32); empty means 1 for every group.
    """

    segments: tuple[tuple[int, int, int], ...]
    predicted_error: float = 0.0
    rows: int = 0
    exact: bool = True
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    clips: tuple[float, ...] = ()

    def kept_clips(self) -> list[float]:
        """The clip of every kept group, in component order."""
        n = sum(rep for _, t, rep in self.segments if t != DROP)
        return list(self.clips) if self.clips else [1.0] * n

    def groups(self) -> list[tuple[int, int, int]]:
        """Expanded ``(start, size, type)`` of every group, dropped ones included."""
        out, pos = [], 0
        for size, qtype, rep in self.segments:
            for _ in range(rep):
                out.append((pos, size, qtype))
                pos += size
        return out

    @property
    def num_components(self) -> int:
        return sum(size * rep for size, _, rep in self.segments)

    @property
    def kept_components(self) -> int:
        """One past the last component a kept group covers: the basis rows the plan needs."""
        end = 0
        for start, size, qtype in self.groups():
            if qtype != DROP:
                end = start + size
        return end

    @property
    def bits_per_token(self) -> int:
        return sum(group_bits(size, qtype) * rep for size, qtype, rep in self.segments)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "segments": [list(s) for s in self.segments],
            "predicted_error": self.predicted_error,
            "rows": self.rows,
            "exact": self.exact,
        }
        if self.clips:
            d["clips"] = list(self.clips)
        return d

    @classmethod
    def from_dict(cls, d: Any, num_components: int) -> Plan:
        try:
            segs = tuple((int(a), int(b), int(c)) for a, b, c in d["segments"])
            plan = cls(
                segments=segs,
                predicted_error=float(d["predicted_error"]),
                rows=int(d["rows"]),
                exact=bool(d["exact"]),
                clips=tuple(float(c) for c in d.get("clips", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationError(f"malformed bit plan: {e!r}; recalibrate with `kvtc calibrate`") from None
        for size, qtype, rep in segs:
            if size <= 0 or rep <= 0 or qtype not in TYPE_NAMES:
                raise CalibrationError(f"malformed bit plan segment {(size, qtype, rep)}")
        if plan.num_components > num_components:
            raise CalibrationError(
                f"bit plan covers {plan.num_components} components, the basis has only {num_components}"
            )
        if any(start % size for start, size, _ in plan.groups()):
            raise CalibrationError("bit plan has an unaligned group; the file is corrupt")
        if plan.clips:
            kept = [(size, t) for _, size, t in plan.groups() if t != DROP]
            if len(plan.clips) != len(kept) or any(
                not (
                    MIN_STEP <= c <= MAX_STEP
                    if t in FIXED_TYPES
                    else 0.0 < c <= 1.0 and (c == 1.0 or clippable(t, size))
                )
                for c, (size, t) in zip(plan.clips, kept)
            ):
                raise CalibrationError("bit plan has clips that do not fit its groups; the file is corrupt")
        return plan


def _run_length(groups: Sequence[tuple[int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Run-length segments of ``(size, type)`` groups, trailing dropped components cut off."""
    groups = list(groups)
    while groups and groups[-1][1] == DROP:
        groups.pop()
    segs: list[list[int]] = []
    for size, qtype in groups:
        if segs and segs[-1][0] == size and segs[-1][1] == qtype:
            segs[-1][2] += 1
        else:
            segs.append([size, qtype, 1])
    return tuple(tuple(s) for s in segs)  # type: ignore[misc]
