"""The fused RoPE-to-cache kernel equals ``RopeSpec.apply`` + permute.

Runs on the CPU through Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``, where Triton is
installed) and on CUDA when there is a GPU (tests/test_gpu.py style)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

CHECK = textwrap.dedent(
    """
    import torch
    from kvtc.kernels.triton_rope import rope_to_heads
    from kvtc.rope import RopeKind, RopeSpec, _compact_cos_sin

    dev = "{dev}"
    gen = torch.Generator().manual_seed(0)
    for half, extra, scaling, dtype in ((4, 0, 1.0, torch.float32), (3, 2, 1.3, torch.float32),
                                       (8, 0, 0.9, torch.bfloat16)):
        d = 2 * half + extra
        if d & (d - 1):
            d = 16; extra = d - 2 * half
        inv = tuple(float(v) for v in torch.rand(half, generator=gen))
        other = tuple(float(v) / 7 for v in torch.rand(half, generator=gen))
        kinds = (RopeKind("full", "yarn", inv, scaling), RopeKind("sliding", "default", other))
        spec = RopeSpec(d, False, kinds, ("full", None, "sliding", "full"))
        x = torch.randn(2, 37, 4, 3, d, generator=gen).to(dtype)
        pos = torch.randint(0, 50_000, (2, 37), generator=gen)
        want = spec.apply(x, pos, [0, 1, 2, 3]).permute(2, 0, 3, 1, 4).contiguous()
        x = x.to(dev)
        cs = [_compact_cos_sin(k, pos.to(dev), torch.float32) for k in kinds]
        cos = torch.stack([c * k.attention_scaling for (c, _), k in zip(cs, kinds)])
        sin = torch.stack([s * k.attention_scaling for (_, s), k in zip(cs, kinds)])
        got = rope_to_heads(x[:, :, :], cos, sin, torch.tensor([0, -1, 1, 0], dtype=torch.int32), 2 * half, dtype)
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got[1].cpu(), want[1]), "a layer without RoPE is copied unchanged"
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        err = (got.cpu().float() - want.float()).abs().max() / want.float().abs().max()
        assert err <= tol, (dtype, float(err))
        # a strided view (the middle of a larger slice) works too
        big = torch.randn(2, 50, 4, 3, d, generator=gen).to(dtype)
        view = big[:, 5:42]
        want2 = spec.apply(view, pos, [0, 1, 2, 3]).permute(2, 0, 3, 1, 4)
        got2 = rope_to_heads(view.to(dev), cos, sin, torch.tensor([0, -1, 1, 0], dtype=torch.int32), 2 * half, dtype)
        assert (got2.cpu().float() - want2.float()).abs().max() <= tol * want2.float().abs().max()
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its CPU interpreter)")
def test_rope_kernel_matches_reference_in_triton_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", CHECK.format(dev="cpu")], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rope_kernel_matches_reference_on_gpu() -> None:
    pytest.importorskip("triton")
    exec(compile(CHECK.format(dev="cuda"), "rope_check", "exec"), {})
