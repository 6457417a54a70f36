"""The codec, composed of parts with symmetric interfaces: the PCA transform (:mod:`.transform`: project /
reconstruct), the quantizer stage (:mod:`.quantizer`: coefficients <-> packed planes), the entropy coders
(:mod:`.entropy`: one protocol and one registry over :mod:`.huffman`, :mod:`.huffman_gpu`, :mod:`.nvcomp` and
zlib / zstd) and the container (:mod:`.container`); :class:`Codec` (:mod:`.codec`) composes them."""

from .codec import DEFAULT_SINKS, DEFAULT_WINDOW, Codec

__all__ = ["DEFAULT_SINKS", "DEFAULT_WINDOW", "Codec"]
