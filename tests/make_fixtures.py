"""Regenerate the checked-in format fixtures (run only when the format version changes):

    python tests/make_fixtures.py

Writes tests/fixtures/{calibration.safetensors, sample.kvtc, sample_input.safetensors, sample_decoded.safetensors}.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from kvtc import KVLayout
from kvtc.calibration import Recipe, fit_calibration
from kvtc.codec import Codec

HERE = Path(__file__).parent / "fixtures"


def build():
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
        Recipe(ratios=(4, 8), dp_rows=256),
        model_id="fixture",
        corpus={"name": "synthetic"},
    )
    n = 40
    keys = rows(n).reshape(1, n, 2, 2, 8).bfloat16()
    values = (rows(n) * 0.3).reshape(1, n, 2, 2, 8).bfloat16()
    return layout, cal, keys, values


def main():
    from kvtc import KVSlice

    HERE.mkdir(exist_ok=True)
    layout, cal, keys, values = build()
    cal.save(HERE / "calibration.safetensors")
    kv = KVSlice(layout, keys, values, torch.arange(7, 7 + keys.shape[1])[None], model_id="fixture")
    codec = Codec(cal, ratio=8, sinks=2, window=4)
    blob = codec.encode(kv)
    (HERE / "sample.kvtc").write_bytes(blob)
    save_file({"keys": keys, "values": values, "positions": kv.positions}, str(HERE / "sample_input.safetensors"))
    out = codec.decode(blob)
    save_file(
        {"keys": out.keys, "values": out.values, "positions": out.positions}, str(HERE / "sample_decoded.safetensors")
    )
    print(f"calibration {cal.hash[:16]}, blob {len(blob)} bytes")


if __name__ == "__main__":
    main()
