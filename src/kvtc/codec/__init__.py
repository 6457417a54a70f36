"""The codec, composed of parts with symmetric interfaces: the PCA transform (:mod:`.transform`: project /
reconstruct), the quantizer stage (:mod:`kvtc.coding.quantizer`: coefficients <-> packed planes), the entropy coders
(:mod:`kvtc.coding.entropy`: one protocol and one registry over :mod:`kvtc.coding.huffman`,
:mod:`kvtc.coding.huffman_gpu`, :mod:`kvtc.coding.nvcomp` and zlib / zstd) and the container (:mod:`.container`);
:class:`Codec` (:mod:`.codec`) composes them."""

import importlib
from typing import Any

from .codec import DEFAULT_SINKS, DEFAULT_WINDOW, Codec

__all__ = ["DEFAULT_SINKS", "DEFAULT_WINDOW", "Codec"]

#: modules that moved to :mod:`kvtc.coding`; ``kvtc.codec.<name>`` is an alias of each, warning, for one release
_MOVED = (
    "buffers",
    "clock",
    "entropy",
    "gaussian",
    "huffman",
    "huffman_codes",
    "huffman_gpu",
    "nvcomp",
    "packing",
    "quantizer",
)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return importlib.import_module(f".{name}", __name__)  # the alias module warns and is the moved one
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
