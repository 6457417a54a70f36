"""Tiered blobs (token-adaptive rates) on the CUDA path against the CPU reference (skipped without CUDA): a blob
encoded on the GPU decodes on the CPU, both ways reconstruct alike, and the GPU ranks the tokens as the CPU does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtc.codec import Codec
from test_tiers import tiered_calibration, tiered_slice

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda(kv):
    return dataclasses.replace(kv, keys=kv.keys.cuda(), values=kv.values.cuda(), positions=kv.positions.cuda())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_tiered_blobs_decode_on_the_cpu_and_rank_as_the_cpu(precision):
    cal = tiered_calibration()
    kv = tiered_slice()
    gpu = Codec(cal, 8, window=16, device="cuda", precision=precision, tiers="two")
    cpu = Codec(cal, 8, window=16, tiers="two")
    assert gpu.tiers == cpu.tiers == ("4", "12", 0.25)
    blob = bytes(gpu.encode(_cuda(kv)))
    ref = cpu.encode(kv)
    _, g_secs = cpu._open(blob)
    _, c_secs = cpu._open(ref)
    for name in (n for n in c_secs if n.startswith("tiers.")):
        agree = float((g_secs[name] == c_secs[name]).float().mean())
        assert agree >= 0.98, (name, agree)  # float32 sums on another device may swap near-tied tokens only
    on_cpu = cpu.decode(blob)
    on_gpu = gpu.decode(blob, device="cuda")
    tol = 1e-4 if precision == "fp32" else 2e-2
    for a, b in ((on_cpu.keys, on_gpu.keys), (on_cpu.values, on_gpu.values)):
        scale = a.abs().max()
        assert (a - b.cpu()).abs().max() <= tol * scale
    assert torch.allclose(gpu.decode(ref, device="cuda").keys.cpu(), cpu.decode(ref).keys, atol=tol * float(scale))
    for li, k, v in gpu.decode_layers(blob, device="cuda"):
        i = kv.layout.layers.index(li)
        for a, b in ((k, on_gpu.keys[:, :, i]), (v, on_gpu.values[:, :, i])):
            assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_rate_ladder_blobs_decode_on_the_cpu_and_choose_as_the_cpu(precision):
    cal = tiered_calibration()
    kv = tiered_slice()
    gpu = Codec(cal, 8, window=16, device="cuda", precision=precision)
    # the GPU's own coder on the CPU (the CPU's default coders store the fixed-step planes under their Gaussians,
    # about a tenth smaller: a byte comparison across coders would measure them, not the encoders)
    cpu = Codec(cal, 8, window=16, backend="huff4k")
    assert gpu.ladder == cpu.ladder == ("4", "8", "12")
    blob = bytes(gpu.encode(_cuda(kv)))
    ref = cpu.encode(kv)
    assert Codec.inspect(blob)["version"] == 4
    _, g_secs = cpu._open(blob)
    _, c_secs = cpu._open(ref)
    # the CPU measures each group's coded size and raises its price where the rows store more than predicted; the
    # GPU's coder codes later, on the device, so a GPU encode keeps the predicted price: the choices differ where
    # that correction moved it (and near a rung's boundary, by float sums on another device), the bytes little
    for name in (n for n in c_secs if n.startswith("rungs.")):
        agree = float((g_secs[name] == c_secs[name]).float().mean())
        assert agree >= 0.75, (name, agree)
    assert 0.9 <= Codec.inspect(blob)["coded_bytes"] / Codec.inspect(ref)["coded_bytes"] <= 1.1
    on_cpu = cpu.decode(blob)
    on_gpu = gpu.decode(blob, device="cuda")
    tol = 1e-4 if precision == "fp32" else 2e-2
    for a, b in ((on_cpu.keys, on_gpu.keys), (on_cpu.values, on_gpu.values)):
        assert (a - b.cpu()).abs().max() <= tol * a.abs().max()
    for li, k, v in gpu.decode_layers(blob, device="cuda"):
        i = kv.layout.layers.index(li)
        for a, b in ((k, on_gpu.keys[:, :, i]), (v, on_gpu.values[:, :, i])):
            assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
