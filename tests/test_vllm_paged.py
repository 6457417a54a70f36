"""Paged-layout adapters of the vLLM connector (no vLLM needed): slots, gather/scatter per layout, and
learning an unknown layout from a writer."""

from __future__ import annotations

import pytest
import torch

from kvtc.errors import LayoutError
from kvtc.integrations.vllm.paged import PagedLayout, probe_writer, slots_for

H, D, N, B = 3, 8, 16, 5


def _kv(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, D, generator=g).bfloat16(), torch.randn(t, H, D, generator=g).bfloat16()


def test_slots_follow_the_block_table():
    s = slots_for([7, 2, 9], N, N - 2, N + 3)
    assert s.tolist() == [7 * N + N - 2, 7 * N + N - 1, 2 * N, 2 * N + 1, 2 * N + 2]
    with pytest.raises(LayoutError):
        slots_for([7], N, 0, N + 1)


# Reference writers: how each backend family places token t's K/V (written out element by element).
def _write_content(cache, slots, k, v):  # FlashAttention / FlashInfer / Triton: [B, H, N, K|V]
    for i, s in enumerate(slots.tolist()):
        cache[s // N, :, s % N, :D] = k[i]
        cache[s // N, :, s % N, D:] = v[i]


def _write_rows(cache, slots, k, v):  # CPU block read as [2N, D]: keys then values
    for i, s in enumerate(slots.tolist()):
        rows = cache[s // N].reshape(H, 2 * N, D)
        rows[:, s % N] = k[i]
        rows[:, N + s % N] = v[i]


def _write_cpu_vec(cache, slots, k, v):  # CPU "vec" kernel: key block transposed [D, N], values [N, D]
    for i, s in enumerate(slots.tolist()):
        flat = cache[s // N].reshape(H, 2 * N * D)
        flat[:, (torch.arange(D) * N + s % N)] = k[i]
        flat[:, N * D + (s % N) * D + torch.arange(D)] = v[i]


FOURD = [("content", _write_content), ("rows", _write_rows)]


@pytest.mark.parametrize("split,writer", FOURD)
def test_declared_4d_layouts_round_trip(split, writer):
    cache = torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16)
    lay = PagedLayout(split, N, H, D)
    slots = slots_for([3, 0, 4], N, 5, 40)
    k, v = _kv(len(slots))
    writer(cache, slots, k, v)  # the backend's placement
    gk, gv = lay.gather(cache, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    other = torch.zeros_like(cache)
    lay.scatter(other, slots, k, v)
    assert torch.equal(other, cache)  # scatter writes exactly what the backend would, nothing else


@pytest.mark.parametrize(
    "split,shape", [("kv_first", (2, B, N, H, D)), ("kv_second", (B, 2, N, H, D)), ("kv_first_hnd", (2, B, H, N, D))]
)
def test_legacy_5d_layouts(split, shape):
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    lay = PagedLayout.for_backend("ANY", cache, H, D)
    assert lay.split == split and lay.block_size == N
    slots = slots_for([1, 3], N, 2, 30)
    k, v = _kv(len(slots), 1)
    lay.scatter(cache, slots, k, v)
    gk, gv = lay.gather(cache, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    # token t of block b, head h: the legacy layouts' documented positions
    s = int(slots[0])
    kk = {
        "kv_first": cache[0, s // N, s % N],
        "kv_second": cache[s // N, 0, s % N],
        "kv_first_hnd": cache[0, s // N, :, s % N],
    }[split]
    assert torch.equal(kk, k[0])


def test_backend_names_choose_the_split():
    cache = torch.zeros(B, H, N, 2 * D)
    assert PagedLayout.for_backend("CPU_ATTN", cache, H, D).split == "rows"
    assert PagedLayout.for_backend("FLASH_ATTN", cache, H, D).split == "content"
    assert PagedLayout.for_backend("FLASHINFER", cache, H, D).split == "content"
    with pytest.raises(LayoutError):
        PagedLayout.for_backend("SOMETHING_NEW", cache, H, D)
    with pytest.raises(LayoutError):
        PagedLayout.for_backend("FLASH_ATTN", torch.zeros(B, H, N, 3 * D), H, D)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("writer", [_write_content, _write_rows, _write_cpu_vec])
def test_probe_learns_any_placement_exactly(writer, dtype):
    """Every cache type (float32 caches once failed: the probe's read-back aliased its scratch block)."""
    like = torch.zeros(B, H, N, 2 * D, dtype=dtype)
    lay = probe_writer(like, lambda k, v, c, s: writer(c, s, k, v), H, D, dtype)
    assert not like.any()  # the real cache is never written
    cache = torch.zeros_like(like)
    slots = slots_for([4, 1, 2], N, 3, 45)
    k, v = (x.to(dtype) for x in _kv(len(slots), 2))
    writer(cache, slots, k, v)
    gk, gv = lay.gather(cache, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    other = torch.zeros_like(cache)
    lay.scatter(other, slots, k, v)
    assert torch.equal(other, cache)


def test_probe_refuses_a_lossy_writer():
    def drops_values(k, v, c, s):
        _write_content(c, s, k, torch.zeros_like(v))

    with pytest.raises(LayoutError):
        probe_writer(torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16), drops_values, H, D, torch.bfloat16)


def test_fp8_cache_is_dequantized_with_the_layer_scale():
    cache = torch.zeros(B, H, N, 2 * D, dtype=torch.uint8)
    lay = PagedLayout.for_backend("FLASH_ATTN", cache, H, D, cache_dtype="fp8")
    slots = slots_for([2], N, 0, N)
    k, v = _kv(N, 3)
    lay.scatter(cache, slots, k, v, k_scale=0.5, v_scale=0.25)
    gk, gv = lay.gather(cache, slots, k_scale=0.5, v_scale=0.25, dtype=torch.float32)
    assert (gk - k.float()).abs().max() <= 0.07 * k.float().abs().max()
    assert (gv - v.float()).abs().max() <= 0.07 * v.float().abs().max()
    raw = cache.view(torch.float8_e4m3fn)[2, :, :, :D].permute(1, 0, 2).float()
    assert torch.allclose(raw * 0.5, gk)  # stored values are K / k_scale


@pytest.mark.parametrize("writer", [_write_content, _write_cpu_vec])
def test_probed_layout_on_a_strided_view_of_a_shared_buffer(writer):
    """vLLM hands logical [blocks, heads, block_size, content] views whose physical stride order differs and
    that start inside a larger buffer: the probed flat offsets must follow the view's strides and offset."""
    buf = torch.zeros(2, B, N, H, 2 * D, dtype=torch.bfloat16)  # two layers, block-major token-head order
    cache = buf[1].permute(0, 2, 1, 3)  # layer 1 as [B, H, N, 2D], non-contiguous, storage offset > 0
    ref = torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16)
    lay = probe_writer(cache, lambda k, v, c, s: writer(c, s, k, v), H, D, torch.bfloat16)
    slots = slots_for([4, 1, 2], N, 3, 45)
    k, v = _kv(len(slots), 4)
    lay.scatter(cache, slots, k, v)
    writer(ref, slots, k, v)
    assert torch.equal(cache, ref) and not buf[0].any()  # exactly the backend's placement, nothing outside
    gk, gv = lay.gather(cache, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
