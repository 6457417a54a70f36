"""Per-stage wall-clock timings of an encode or decode (``timings=`` of :class:`kvtc.codec.Codec`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Clock:
    """``with clock("stage"):`` adds the block's seconds to ``sink[stage]`` (CUDA synchronized at both ends);
    with no sink it times nothing."""

    def __init__(self, sink: dict[str, float] | None):
        self.sink = sink

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if self.sink is None:
            yield
            return
        if self.sink is not None and torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.sink[stage] = self.sink.get(stage, 0.0) + time.perf_counter() - t0


__all__ = ["Clock"]
