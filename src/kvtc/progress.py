"""Progress bars and stage timers, written once for the whole library.

* :func:`bar`: a tqdm bar when ``enabled`` and tqdm is installed, else a silent stand-in with the same methods;
  either is callable with a count, so it can be passed where a ``progress(n)`` callback is expected.
* :class:`StageTimer`: seconds per named stage, summed over repeats, with an optional CUDA synchronisation
  around each stage (so asynchronous GPU work is charged to the stage that launched it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Bar", "StageTimer", "bar"]


class Bar:
    """A progress bar over ``total`` units; silent when tqdm is absent or the bar is disabled."""

    def __init__(self, total: int, desc: str, enabled: bool = True, unit: str = "it") -> None:
        self._tqdm: Any = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # pragma: no cover - tqdm comes with transformers
                return
            self._tqdm = tqdm(total=total, desc=desc, unit=unit, smoothing=0.1)

    def update(self, n: int = 1) -> None:
        if self._tqdm is not None:
            self._tqdm.update(n)

    __call__ = update

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(total: int, desc: str, enabled: bool = True, unit: str = "it") -> Bar:
    """A :class:`Bar` of ``total`` ``unit``\\ s labelled ``desc`` (silent unless ``enabled``)."""
    return Bar(total, desc, enabled, unit)


class StageTimer:
    """Wall seconds per stage: ``with timer("encode"): ...`` adds the block's duration to ``seconds["encode"]``.

    ``seconds``: the dictionary to add into (a caller's ``timings=`` argument; default a new one).
    ``enabled=False`` makes every block free (no clock read, no synchronisation). ``cuda_sync``: synchronise
    CUDA before and after each block when a GPU is present, so its queued work is counted where it was queued.
    """

    def __init__(
        self, seconds: dict[str, float] | None = None, *, enabled: bool = True, cuda_sync: bool = False
    ) -> None:
        self.seconds: dict[str, float] = {} if seconds is None else seconds
        self.enabled = enabled
        self._cuda = False
        if enabled and cuda_sync:
            import torch

            self._cuda = torch.cuda.is_available()
        self._t0 = time.perf_counter()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.add(stage, time.perf_counter() - t0)

    def add(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` to ``stage`` (for a duration measured elsewhere)."""
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def iterate(self, items: Iterable[T], stage: str) -> Iterator[T]:
        """Yield ``items``, charging to ``stage`` only the time spent producing each one (not the consumer's);
        the stage is present (at 0.0) even when there is no item."""
        if not self.enabled:
            yield from items
            return
        self.add(stage, 0.0)
        it = iter(items)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.add(stage, time.perf_counter() - t0)
            yield item

    def elapsed(self) -> float:
        """Seconds since the timer was made."""
        return time.perf_counter() - self._t0

    def rounded(self, digits: int = 2) -> dict[str, float]:
        """The stages' seconds rounded to ``digits``, in the order they first ran."""
        return {k: round(v, digits) for k, v in self.seconds.items()}

    def _sync(self) -> None:
        if self._cuda:
            import torch

            torch.cuda.synchronize()
