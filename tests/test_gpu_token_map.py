"""Token-map blobs (container version 5) on the CUDA path against the CPU reference (skipped without CUDA): blobs
encoded on either device decode to the same reconstruction on both, whole and layer by layer, with the token ids the
blob carries."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvtc import KVSlice
from kvtc.calibration import Calibration
from kvtc.codec import Codec
from kvtc.coding.entropy import BACKENDS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FIX = Path(__file__).parent / "fixtures" / "predicted"


@pytest.mark.parametrize("backend", [b for b in ("zstd", "huff4k") if b in BACKENDS])
def test_token_map_blobs_decode_the_same_on_both_devices(backend):
    from kvtc import kernels

    if not kernels.available("cuda"):
        pytest.skip("Triton kernels unavailable")
    cal = Calibration.load(FIX / "calibration.safetensors")
    emb = load_file(str(FIX / "embeddings.safetensors"))["weight"]
    inp = load_file(str(FIX / "sample_input.safetensors"))
    kv = KVSlice(cal.layout, inp["keys"], inp["values"], inp["positions"], "fixture", inp["token_ids"])
    cpu = Codec(cal, ratio=8, sinks=2, window=4, backend=backend, embeddings=emb)
    gpu = Codec(cal, ratio=8, sinks=2, window=4, backend=backend, device="cuda", embeddings=emb.cuda())
    on_gpu = dataclasses.replace(kv, keys=kv.keys.cuda(), values=kv.values.cuda(), positions=kv.positions.cuda())
    for blob in (cpu.encode(kv), gpu.encode(on_gpu)):
        assert Codec.inspect(blob)["version"] == 5
        a = cpu.decode(blob)
        b = gpu.decode(blob, device="cuda")
        assert torch.equal(a.token_ids, kv.token_ids) and torch.equal(b.token_ids.cpu(), kv.token_ids)
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            energy = max(float(x.float().square().sum()), 1.0)
            assert float((x.float() - y.float().cpu()).square().sum()) <= 1e-4 * energy
        for i, (_layer, k, v) in enumerate(gpu.decode_layers(blob, device="cuda")):
            assert torch.allclose(k.float(), b.keys[:, :, i].float(), atol=1e-2 * float(b.keys.abs().max()))
            assert torch.allclose(v.float(), b.values[:, :, i].float(), atol=1e-2 * float(b.values.abs().max()))
        # and close to what was coded: the prediction went back in on the device too
        err = float((b.keys.float().cpu() - kv.keys.float()).norm() / kv.keys.float().norm())
        assert err < 0.2, err
