"""The connector's counters, as vLLM's KV-transfer statistics.

Each worker keeps a :class:`Tally` of what it stored and restored; vLLM collects it after every step through
``get_kv_connector_stats`` (:meth:`Tally.take` empties it), adds up the workers' and steps' figures with
:class:`~.connector.KVTCStats` and, when statistics logging is on, logs them periodically as ``KV Transfer metrics: ...``.
Every figure counts what really happened: a chunk counts as stored only once the store took it, a token as
restored only once it was written into the paged cache.
"""

from __future__ import annotations

import threading

#: the counters, in the order they are logged
FIELDS = (
    "stored_chunks",  # chunks the store took
    "stored_tokens",  # their tokens
    "stored_bytes",  # their compressed bytes, every byte of each blob counted
    "save_failures",  # chunks whose encoding or put raised
    "saves_refused",  # chunks the store did not take, or the save queue had no room for
    "restored_tokens",  # tokens written into the paged cache from the store
    "restore_failed_tokens",  # tokens planned for restoring that vLLM recomputed instead
)


class Tally:
    """Thread-safe counters of one worker (saves are reported from the codec process's reply thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(FIELDS, 0)

    def add(self, **counts: int) -> None:
        unknown = set(counts) - set(FIELDS)
        if unknown:
            raise KeyError(f"unknown connector counters {sorted(unknown)}")
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += int(n)

    def take(self) -> dict[str, int]:
        """The counts since the last call, zeroed."""
        with self._lock:
            out, self._counts = self._counts, dict.fromkeys(FIELDS, 0)
        return out


__all__ = ["FIELDS", "Tally"]
