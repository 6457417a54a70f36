"""Saving off the forward path: one background thread that encodes and stores chunks copied out of the cache.

The worker copies a completed chunk out of the paged cache in ``wait_for_save`` (a gather: milliseconds) and
hands the copy here; RoPE inversion, encoding and the store's put run on this thread while vLLM goes on with the
next step. Because the chunk is copied before ``wait_for_save`` returns, vLLM may free or reuse its blocks at
once: no block is held for a save (a sliding-window group frees blocks while its request still runs, so holding
the request's blocks would not protect them anyway).

The copies waiting here are bounded (``max_bytes``): a chunk that would exceed the bound is dropped, which is
only a future cache miss, and counted. On shutdown the queue is drained before the store is closed.

On a machine where vLLM leaves CPUs to other processes (``VLLM_CPU_NUM_OF_RESERVED_CPU``, see docs/VLLM.md), the
thread moves itself to the CPUs the model's OpenMP threads are not bound to, so encoding does not take cycles
from the forward pass.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kvtc.vllm")

#: Bytes of copied chunks that may wait for the background encoder (more are dropped: a future cache miss).
DEFAULT_MAX_PENDING_BYTES = 1 << 30


def spare_cpus() -> set[int]:
    """CPUs this process may use that vLLM did not bind the model's OpenMP threads to (``OMP_PLACES`` as vLLM's CPU
    worker sets it, e.g. ``{0,1}``); empty when there are none or the binding is unknown."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set()
    places = os.environ.get("OMP_PLACES", "")
    bound = {int(x) for x in re.findall(r"\d+", places)} if re.fullmatch(r"\{[\d,\s]+\}", places.strip()) else set()
    return allowed - bound if bound else set()


class Background:
    """A bounded queue of work items run in order on one daemon thread by ``work(item)``."""

    def __init__(self, name: str, work: Callable[[Any], None], max_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        self.name = name
        self.work = work
        self.max_bytes = max_bytes
        self._queue: queue.Queue[tuple[Any, int] | None] = queue.Queue()
        self._lock = threading.Condition()
        self._pending = 0  # items queued or running
        self._pending_bytes = 0
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def submit(self, item: Any, nbytes: int) -> bool:
        """Queue ``item`` (holding ``nbytes``); False (dropped) when the queue already holds ``max_bytes``."""
        with self._lock:
            if self._pending and self._pending_bytes + nbytes > self.max_bytes:
                self.dropped += 1
                return False
            self._pending += 1
            self._pending_bytes += nbytes
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put((item, nbytes))
        return True

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def _run(self) -> None:
        cpus = spare_cpus()
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)  # this thread only
            except OSError:
                pass
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            item, nbytes = entry
            try:
                self.work(item)
            except Exception:  # noqa: BLE001 - the work function reports its own failures; never kill the thread
                logger.exception("KVTCConnector: background %s failed", self.name)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._pending_bytes -= nbytes
                    self._lock.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued item has run; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Run what is queued (up to ``timeout`` seconds), then stop the thread."""
        done = self.flush(timeout)
        if self._thread is not None:
            self._queue.put(None)
            if done:
                self._thread.join(timeout=5)
        return done
