"""Quantizers, packing, entropy backends, the container format and the ``Codec``."""

from .codec import DEFAULT_SINKS, DEFAULT_WINDOW, Codec

__all__ = ["DEFAULT_SINKS", "DEFAULT_WINDOW", "Codec"]
