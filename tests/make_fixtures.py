"""Regenerate the checked-in format fixtures (run only when the format changes):

    python tests/make_fixtures.py            # the small, current and token-map sets
    python tests/make_fixtures.py --out DIR  # the same sets under DIR (to compare with the checked-in ones)

Each set is a calibration (file version 11: float16 PCA bases, an int8 token map), a slice (``sample_input.safetensors``), its blob
(``sample.kvtc``) and what the blob decodes to (``sample_decoded.safetensors``); every blob must decode byte for byte
and its slice re-encode to the same bytes.

- tests/fixtures/ (the small set, 40 tokens): the corruption tests flip and cut every byte of its blob.
- tests/fixtures/current/ (256 tokens): enough tokens that the fixed-step planes' Gaussians beat zstd, so the blob
  uses every coder the CPU encoder chooses (``gauss`` planes, delta-coded positions).
- tests/fixtures/predicted/ (and ``embeddings.safetensors``): a calibration that carries a token map and a blob
  that carries its token ids (container version 5), each middle token coded less the map's prediction. The
  embeddings and the map hold small multiples of 1/8, so the prediction is exact in float32 whatever order a CPU
  sums in.

tests/fixtures/legacy/ is not written here: files of formats this kvtc refuses (calibration versions 1, 9 and 10, a blob
of the first encoder), kept to test that they are refused with a message saying to rebuild.
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


def build(recipe=None, n=40):
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
    keys = rows(n).reshape(1, n, 2, 2, 8).bfloat16()
    values = (rows(n) * 0.3).reshape(1, n, 2, 2, 8).bfloat16()
    return layout, cal, keys, values


def write(here, recipe=None, tokens=40):
    from kvtc import KVSlice

    here.mkdir(parents=True, exist_ok=True)
    layout, cal, keys, values = build(recipe, tokens)
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


def write_predicted(here, tokens=256):
    """The token-map set: rows whose K/V are a base plus an exact linear function of the ids' embeddings."""
    from kvtc import KVSlice
    from kvtc.calibration.token_map import LAGS, TokenMap, lagged, probe_ids

    here.mkdir(parents=True, exist_ok=True)
    # the calibration is the build's own, fitted on its base rows: the residuals the blob's K/V leave
    layout, cal, keys, values = build(Recipe(ratios=(4, 8), dp_rows=256), tokens)
    g = torch.Generator().manual_seed(99)
    vocab, dim, p = 64, 4, layout.num_features
    emb = torch.randint(-4, 5, (vocab, dim), generator=g).float()
    # int8 weights in -4..4 with column scales of 1/8 (as a calibration stores a map): weights of 1/8 steps
    weights = {k: torch.randint(-4, 5, (LAGS * dim, p), generator=g).to(torch.int8) for k in ("keys", "values")}
    scales = {k: torch.full((p,), 1 / 8) for k in weights}
    f = LAGS * dim
    tm = TokenMap(LAGS, vocab, torch.zeros(f), torch.ones(f), weights, scales, emb[probe_ids(vocab)])

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
    write(root)
    write(root / "current", Recipe(ratios=(4, 8), dp_rows=256), tokens=256)
    write_predicted(root / "predicted")


if __name__ == "__main__":
    main()
