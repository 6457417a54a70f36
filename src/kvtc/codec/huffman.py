"""Deprecated: moved to :mod:`kvtc.coding.huffman` (below the codec and the calibration); this alias goes in the next
release."""

from ..lazy import moved_module

moved_module(__name__, "kvtc.coding.huffman")
