"""Per-stage wall-clock timings of an encode or decode (``timings=`` of :class:`kvtc.codec.Codec`): the
library's one stage timer (:class:`kvtc.progress.StageTimer`), CUDA synchronised around each stage."""

from __future__ import annotations

from ..progress import StageTimer

#: what the codec's stages are timed with
Clock = StageTimer


def stage_clock(timings: dict[str, float] | None) -> StageTimer:
    """A timer adding each stage's seconds to ``timings`` (CUDA synchronised at both ends); with no
    ``timings`` it times nothing."""
    return StageTimer(timings, enabled=timings is not None, cuda_sync=True)


__all__ = ["Clock", "stage_clock"]
