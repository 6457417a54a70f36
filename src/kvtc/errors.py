"""Typed errors. Every message says what was wrong and what to do about it."""

from __future__ import annotations


class KVTCError(Exception):
    """Base class of every error kvtc raises on purpose."""


class FormatError(KVTCError, ValueError):
    """A blob or file is not a valid kvtc container / calibration (corrupt, truncated, foreign)."""


class CalibrationError(KVTCError, ValueError):
    """A calibration artifact is malformed or cannot serve the request (e.g. no plan for a ratio)."""


class CalibrationMismatch(KVTCError, ValueError):
    """Data and calibration do not belong together (other model, layout, RoPE or calibration hash)."""


class LayoutError(KVTCError, ValueError):
    """A KV layout or tensor shape is unsupported or inconsistent."""


class UnsupportedModel(KVTCError, ValueError):
    """The model's attention / RoPE variant is not supported by this version of kvtc."""


class OutputBufferError(KVTCError, ValueError):
    """A caller-provided output buffer cannot take a blob (too small, read-only, wrong kind); nothing was written.
    ``needed``: the bytes the blob needs (0 when the buffer is unusable whatever its size)."""

    def __init__(self, message: str, needed: int = 0):
        super().__init__(message)
        self.needed = needed


class StoreError(KVTCError, OSError):
    """A cache store failed in a way the caller must handle (not a plain miss)."""


class ConfigError(KVTCError, ValueError):
    """A configuration value is unusable (unknown key, wrong type, out of range, names nothing that works);
    the message names the key, the value and the fix."""
