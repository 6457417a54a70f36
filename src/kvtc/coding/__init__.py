"""The coding stage below both the codec and the calibration: PCA coefficients to stored bytes and back.

The quantizer (:mod:`.quantizer`: coefficients <-> per-token params and packed planes, by a bit plan), bit packing
(:mod:`.packing`), the entropy coders behind one protocol and one registry (:mod:`.entropy` over :mod:`.huffman`,
:mod:`.huffman_codes`, :mod:`.huffman_gpu`, :mod:`.nvcomp`, :mod:`.gaussian` and zlib / zstd), the host/device
byte helpers (:mod:`.buffers`) and the stage timer (:mod:`.clock`). The codec (:mod:`kvtc.codec`) writes blobs with
them; the calibration (:mod:`kvtc.calibration.fit`) counts the bits a plan stores with the same code.
"""
