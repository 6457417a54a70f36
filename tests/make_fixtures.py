"""Regenerate the checked-in format fixtures (run only when the format changes):

    python tests/make_fixtures.py            # the current, token-map and float16-basis sets
    python tests/make_fixtures.py --legacy   # also the first set (container version 1, zstd only)
    python tests/make_fixtures.py --out DIR  # the same sets under DIR (to compare with the checked-in ones)

The first set, tests/fixtures/{calibration.safetensors, sample.kvtc, sample_input.safetensors,
sample_decoded.safetensors}, was written by the first encoder and is kept as it is: every later decoder must read it.
The current set, tests/fixtures/current/ (the same files), uses every coder the CPU encoder chooses today
(fixed-step planes under their Gaussians, delta-coded positions); its blob must re-encode byte for byte.
The token-map set, tests/fixtures/predicted/ (the same files and ``embeddings.safetensors``), is container version 5:
a calibration that carries a token map, a blob that carries its token ids and codes each middle token less the
map's prediction. The embeddings and the map hold small multiples of 1/8, so the prediction is exact in float32
whatever order a CPU sums in; its blob must re-encode byte for byte too.
The current and token-map sets keep float32 PCA bases (calibration versions 6 and 9, as they were written: every
later reader must read them). The float16-basis set, tests/fixtures/half/ (the
current set's files), is what kvtc writes now: a calibration of version 10, its bases stored as float16, and a blob
encoded with the calibration as fitted (which holds the same float16 bases), re-encoding byte for byte with the file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvtc import KVLayout
from kvtc.calibration import Recipe, fit_calibration
from kvtc.codec import Codec

HERE = Path(__file__).parent / "fixtures"


def build(recipe=None, n=40, basis_dtype=None):
    layout = KVLayout(layers=(0, 3), num_kv_heads=2, head_dim=8, dtype="bfloat16")
    g = torch.Generator().manual_seed(1234)
    p = layout.num_features
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
    sd = torch.logspace(0.5, -2, p)

    def rows(n):
        return (torch.randn(n, p, generator=g) * sd) @ q.T + 0.5

    cal = fit_calibration(
        layout,
        [(rows(512), rows(512) * 0.3)],
        recipe or Recipe(ratios=(4, 8), dp_rows=256),
        model_id="fixture",
        corpus={"name": "synthetic"},
    )
    if basis_dtype is not None:  # float32: the bases as files before version 10 hold them
        cal = dataclasses.replace(cal, basis_dtype=basis_dtype)
    keys = rows(n).reshape(1, n, 2, 2, 8).bfloat16()
    values = (rows(n) * 0.3).reshape(1, n, 2, 2, 8).bfloat16()
    return layout, cal, keys, values


def write(here, recipe=None, tokens=40, basis_dtype=None):
    from kvtc import KVSlice

    here.mkdir(parents=True, exist_ok=True)
    layout, cal, keys, values = build(recipe, tokens, basis_dtype)
    cal.save(here / "calibration.safetensors")
    kv = KVSlice(layout, keys, values, torch.arange(7, 7 + keys.shape[1])[None], model_id="fixture")
    codec = Codec(cal, ratio=8, sinks=2, window=4)
    blob = codec.encode(kv)
    (here / "sample.kvtc").write_bytes(blob)
    save_file({"keys": keys, "values": values, "positions": kv.positions}, str(here / "sample_input.safetensors"))
    out = codec.decode(blob)
    save_file(
        {"keys": out.keys, "values": out.values, "positions": out.positions}, str(here / "sample_decoded.safetensors")
    )
    backends = sorted({s["backend"] for s in Codec.inspect(blob)["sections"]})
    print(f"{here}: calibration {cal.hash[:16]} (version {cal.version}), blob {len(blob)} bytes, backends {backends}")


def write_predicted(here, tokens=256, basis_dtype=torch.float32):
    """The token-map set: rows whose K/V are a base plus an exact linear function of the ids' embeddings."""
    from kvtc import KVSlice
    from kvtc.calibration.token_map import LAGS, TokenMap, lagged, probe_ids

    here.mkdir(parents=True, exist_ok=True)
    # the calibration is the build's own, fitted on its base rows: the residuals the blob's K/V leave
    layout, cal, keys, values = build(Recipe(ratios=(4, 8), dp_rows=256), tokens, basis_dtype)
    g = torch.Generator().manual_seed(99)
    vocab, dim, p = 64, 4, layout.num_features
    emb = torch.randint(-4, 5, (vocab, dim), generator=g).float()
    weights = {k: (torch.randint(-4, 5, (LAGS * dim, p), generator=g) / 8).half() for k in ("keys", "values")}
    f = LAGS * dim
    tm = TokenMap(LAGS, vocab, torch.zeros(f), torch.ones(f), weights, emb[probe_ids(vocab)])

    def predicted(ids):
        x = lagged(emb, ids, LAGS)
        return {k: tm.predict(x, k) for k in weights}

    cal = dataclasses.replace(cal, token_map=tm)
    cal.save(here / "calibration.safetensors")
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    pred = predicted(ids)
    shape = keys.shape
    keys = (keys.float() + pred["keys"].view(shape)).bfloat16()
    values = (values.float() + pred["values"].view(shape)).bfloat16()
    positions = torch.arange(7, 7 + tokens)[None]
    kv = KVSlice(layout, keys, values, positions, model_id="fixture", token_ids=ids)
    codec = Codec(cal, ratio=8, sinks=2, window=4, embeddings=emb)
    blob = codec.encode(kv)
    (here / "sample.kvtc").write_bytes(blob)
    save_file({"weight": emb}, str(here / "embeddings.safetensors"))
    save_file(
        {"keys": keys, "values": values, "positions": positions, "token_ids": ids},
        str(here / "sample_input.safetensors"),
    )
    out = codec.decode(blob)
    save_file(
        {"keys": out.keys, "values": out.values, "positions": out.positions}, str(here / "sample_decoded.safetensors")
    )
    print(f"{here}: calibration {cal.hash[:16]}, blob {len(blob)} bytes, version {Codec.inspect(blob)['version']}")


def main():
    import sys

    root = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else HERE
    if "--legacy" in sys.argv:
        write(root)
    # more tokens than the first set, so that the fixed-step planes' Gaussians beat zstd
    write(root / "current", Recipe(ratios=(4, 8), dp_rows=256), tokens=256, basis_dtype=torch.float32)
    write_predicted(root / "predicted")
    write(root / "half", Recipe(ratios=(4, 8), dp_rows=256), tokens=256)


if __name__ == "__main__":
    main()
