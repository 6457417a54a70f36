"""The ``gauss`` entropy backend: fixed-step planes coded under their components' Gaussians (kvtc.coding.gaussian)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvtc.coding import entropy, gaussian
from kvtc.coding.packing import pack
from kvtc.errors import FormatError

pytestmark = pytest.mark.skipif(not gaussian.available(), reason="constriction is not installed")


def _planes(bits, packing, pieces, seed=0):
    """Packed planes of quantized Gaussians of each row's standard deviation, and their hint."""
    rng = np.random.default_rng(seed)
    half = {2: 1, 4: 7, 8: 127}[bits]
    data, hint_pieces = b"", []
    for n, stds in pieces:
        x = rng.standard_normal((len(stds), n)) * np.asarray(stds)[:, None]
        q = np.clip(np.rint(x), -half, half).astype(np.int64) + half
        data += pack(torch.from_numpy(q.astype(np.uint8)), bits, packing).numpy().tobytes()
        hint_pieces.append((n, gaussian.std_index(torch.tensor(stds, dtype=torch.float64))))
    return data, gaussian.Hint(bits, packing, tuple(hint_pieces))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("packing", ["bits", "bytes"])
def test_round_trip_is_exact_and_near_the_cross_entropy(bits, packing):
    pieces = [(1000, [0.3, 1.0, 2.5, 0.05]), (7, [1.0, 9.0]), (333, [40.0] if bits == 8 else [3.0])]
    data, hint = _planes(bits, packing, pieces)
    coded = gaussian.compress(data, hint)
    assert gaussian.decompress(coded, len(data), hint) == data
    # the stream costs about the symbols' cross-entropy under the models (plus the CRC and the coder's last word)
    syms = gaussian._symbols(data, hint)
    ideal = 0.0
    for (_, ks), s in zip(hint.pieces, syms):
        for k, row in zip(ks.tolist(), s):
            ideal -= np.log2(gaussian.probabilities(bits, k)[row]).sum()
    assert 8 * len(coded) <= ideal * 1.01 + 8 * 16


def test_models_are_distributions_over_every_symbol():
    for bits in (2, 4, 8):
        for k in (gaussian.LOWEST, -9, 0, 7, 40, gaussian.HIGHEST):
            p = gaussian.probabilities(bits, k)
            assert p.shape == (1 << bits,) and math.isclose(p.sum(), 1.0, rel_tol=1e-12)
            assert (p >= gaussian.FLOOR / (1 << bits)).all()  # any symbol is codable, even one never written
    # a narrow model puts nearly all its mass on zero (symbol h), a wide one spreads it
    assert gaussian.probabilities(4, -24)[7] > 0.999 and gaussian.probabilities(4, 24)[7] < 0.2


def test_std_index_rounds_to_the_grid_and_clamps():
    ks = gaussian.std_index(torch.tensor([1.0, 2.0, 2.0**0.3, 0.0, 1e30]))
    assert ks.tolist() == [0, gaussian.GRID, 2, gaussian.LOWEST, gaussian.HIGHEST]


def test_beats_zstd_on_planes_of_mixed_spreads():
    data, hint = _planes(4, "bits", [(2000, [0.1, 0.2, 0.4, 0.8, 1.6, 3.2] * 4)])
    z = entropy.get_backend("zstd").compress(data)
    assert len(gaussian.compress(data, hint)) < 0.93 * len(z)
    used, _ = entropy.encode_stream(entropy.Modeled(data, hint), "zstd")
    assert used == "gauss"
    assert entropy.encode_stream(entropy.Modeled(data, hint), "raw")[0] == "raw"  # only beside zstd / zlib


def test_corrupt_or_mismatched_streams_are_refused():
    data, hint = _planes(4, "bits", [(500, [0.5, 2.0, 6.0])])
    coded = gaussian.compress(data, hint)
    other = gaussian.Hint(4, "bits", ((500, hint.pieces[0][1] + 3),))  # a decoder whose model differs
    with pytest.raises(FormatError, match="other planes|corrupt|longer"):
        gaussian.decompress(coded, len(data), other)
    with pytest.raises(FormatError):
        gaussian.decompress(coded, len(data), None)  # a gauss stream where no plane is expected
    with pytest.raises(FormatError):
        gaussian.decompress(coded, len(data) + 1, hint)  # sizes that disagree with the plan
    with pytest.raises(FormatError):
        gaussian.decompress(coded[:-3], len(data), hint)  # not whole words
    with pytest.raises(FormatError):
        gaussian.decompress(coded + coded[-4:], len(data), hint)  # trailing words
    bad = bytearray(coded)
    bad[len(bad) // 2] ^= 0x10
    with pytest.raises(FormatError):
        gaussian.decompress(bytes(bad), len(data), hint)


def test_positions_are_delta_coded():
    pos = torch.arange(1000, 1000 + 4096, dtype=torch.int64).reshape(2, 2048).numpy().astype("<i8").tobytes()
    used, coded = entropy.encode_stream(entropy.Int64s(pos), "zstd")
    assert used == entropy.DELTA64 and len(coded) < 64
    assert entropy.decode_stream(coded, used, len(pos)) == pos
    odd = pos + b"\x01\x02\x03"  # a tail of fewer than 8 bytes passes through
    assert entropy.decode_stream(entropy.get_backend(entropy.DELTA64).compress(odd), entropy.DELTA64, len(odd)) == odd
