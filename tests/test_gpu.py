"""The CUDA path against the CPU reference (skipped without CUDA).

Fused kernels: symbols, shifts and scales bit for bit against kvtc.quant + kvtc.coding.packing, on fresh random
inputs, every type, group size and packing. Codec: blobs encoded on the GPU decode on the CPU and the reverse,
with reconstructions equal within float32 rounding. Entropy: nvCOMP's Deflate chunks and the CPU twin decode
each other's streams.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtc import KVLayout
from kvtc.calibration import Recipe, fit_calibration
from kvtc.calibration.dp import Plan
from kvtc.codec import Codec
from kvtc.codec.codec import CODED_TYPES
from kvtc.coding import nvcomp as gpu_entropy
from kvtc.coding.entropy import BACKENDS, device_coder
from kvtc.coding.packing import pack, packed_plane_bytes
from kvtc.quant import (
    CLIPS,
    INT1S,
    INT2F,
    INT4F,
    INT4S,
    INT8F,
    TYPE_BITS,
    clippable,
    dequantize,
    fixed_step,
    param_rows,
    quantize,
)
from synthetic import LowRankSource, make_slice

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda(kv):
    return dataclasses.replace(kv, keys=kv.keys.cuda(), values=kv.values.cuda(), positions=kv.positions.cuda())


def _kernels():
    from kvtc import kernels

    if not kernels.available("cuda"):
        pytest.skip("Triton kernels unavailable")
    return kernels


@pytest.mark.parametrize("qtype", CODED_TYPES)
@pytest.mark.parametrize("size", [1, 16, 64, 256, 1024])
@pytest.mark.parametrize("packing", ["bits", "bytes"])
@pytest.mark.parametrize("n", [203, 4099])
def test_fused_kernels_match_reference_bit_for_bit(qtype, size, packing, n):
    kernels = _kernels()
    g = torch.Generator().manual_seed(hash((qtype, size, packing, n)) % 2**31)
    ng = 3
    k = size * ng + 7
    x = torch.randn(n, k, generator=g) * torch.logspace(1, -3, k) + torch.randn(k, generator=g)
    x[: min(n, 3), 7 : 7 + size] = 0.5  # constant groups: scale 0
    order = torch.randperm(ng, generator=g)
    col0 = torch.tensor([7 + i * size for i in range(ng)], dtype=torch.int32)
    row0 = (order * size).to(torch.int32)
    npar = param_rows(qtype)
    prow = (order * npar + 1).to(torch.int32)  # first param row of each group (row 0 is left alone)
    nb = packed_plane_bytes(n, TYPE_BITS[qtype], packing)
    dev = torch.device("cuda")
    xd = x.to(dev)
    params = torch.full((ng * npar + 2, n), float("nan"), dtype=torch.float16, device=dev)
    plane = torch.full((ng * size, nb), 0xAB, dtype=torch.uint8, device=dev)
    args = (col0.to(dev), row0.to(dev), prow.to(dev))
    clips = None
    if clippable(qtype, size):  # encoder clips per group, one of them 1
        clips = torch.tensor(CLIPS, dtype=torch.float32)[torch.randint(len(CLIPS), (ng,), generator=g)]
        clips[0] = 1.0
    elif fixed_step(qtype):  # the plan's steps, one per group: fine (no clamping) to coarse (most symbols clamp)
        clips = torch.tensor([0.003, 0.11, 1.7], dtype=torch.float32)
    kernels.quantize_pack(xd, *args, qtype, size, params, plane, packing, None if clips is None else clips.to(dev))

    xs = torch.stack([x[:, c : c + size] for c in col0.tolist()], 1)
    sym, sh, sc = quantize(xs, qtype, 1.0 if clips is None else clips)
    ref = torch.empty(ng * size, n, dtype=torch.uint8)
    for i in range(ng):
        ref[row0[i] : row0[i] + size] = sym[:, i].T
    assert torch.equal(plane.cpu(), pack(ref, TYPE_BITS[qtype], packing))
    pr = prow.long()
    if npar == 2:
        assert torch.equal(params[pr].cpu().view(torch.int16), sh.T.contiguous().view(torch.int16))
    if npar:
        assert torch.equal(params[pr + npar - 1].cpu().view(torch.int16), sc.T.contiguous().view(torch.int16))
    untouched = torch.ones(ng * npar + 2, dtype=torch.bool)
    for r in pr.tolist():
        untouched[r : r + npar] = False
    assert bool(params[untouched.to(dev)].isnan().all())  # nothing written outside the groups' rows

    out = torch.full((n, k), float("nan"), device=dev)
    steps = clips.to(dev) if fixed_step(qtype) else None
    kernels.unpack_dequantize(out, *args, qtype, size, params, plane, packing, steps=steps)
    deq = dequantize(sym, sh, sc, qtype, clips if fixed_step(qtype) else None)
    for i, c in enumerate(col0.tolist()):
        assert torch.equal(out[:, c : c + size].cpu(), deq[:, i])


@pytest.fixture(scope="module", params=["plain", "weighted"])
def setup(request):
    layout = KVLayout(layers=(0, 1, 3), num_kv_heads=2, head_dim=64, dtype="bfloat16")
    p = layout.num_features
    ks = LowRankSource(p, decay=1e-3, noise=1e-3, seed=3)
    vs = LowRankSource(p, decay=1e-2, noise=1e-3, seed=4)
    scales = None
    if request.param == "weighted":  # a sensitivity-weighted calibration: distinct encode and decode bases
        g = torch.Generator().manual_seed(5)
        scales = {
            k: torch.logspace(-1, 1, 6)[torch.randperm(6, generator=g)].repeat_interleave(64)
            for k in ("keys", "values")
        }
    cal = fit_calibration(
        layout,
        [(ks.rows(2048), vs.rows(2048)) for _ in range(3)],
        Recipe(ratios=(4, 16, 64), dp_rows=1024),
        feature_scale=scales,
    )
    kv = make_slice(layout, ks.rows(2 * 700), vs.rows(2 * 700), batch=2)
    return cal, kv


@pytest.mark.parametrize("backend", [b for b in ("zstd", gpu_entropy.NAME, "huff4k") if b in BACKENDS])
@pytest.mark.parametrize("ratio", [4, 16, 64])
def test_cross_device_blobs_decode_to_the_same_reconstruction(setup, backend, ratio):
    _kernels()
    cal, kv = setup
    cpu = Codec(cal, ratio=ratio, backend=backend)
    gpu = Codec(cal, ratio=ratio, backend=backend, device="cuda")
    blob_cpu = cpu.encode(kv)
    blob_gpu = gpu.encode(_cuda(kv))
    # same container, same sections; symbols equal except where fp32 matmuls round differently
    info_c, info_g = Codec.inspect(blob_cpu), Codec.inspect(blob_gpu)
    assert [s["name"] for s in info_c["sections"]] == [s["name"] for s in info_g["sections"]]
    for blob in (blob_cpu, blob_gpu):
        a = cpu.decode(blob)
        b = gpu.decode(blob)
        c = gpu.decode(blob, device="cuda")
        for x, y, z in ((a.keys, b.keys, c.keys), (a.values, b.values, c.values)):
            x, y, z = x.float(), y.float(), z.float().cpu()
            tol = 1e-5 * float(x.abs().max()) + 1e-6
            # bf16 output: one bf16 ulp where the fp32 sums round across a bf16 boundary
            assert float((x - y).abs().max()) <= max(tol, float(x.abs().max()) * 2**-7)
            assert torch.equal(y, z)
    ref = cpu.decode(blob_cpu)
    other = cpu.decode(blob_gpu)
    for x, y in ((ref.keys, other.keys), (ref.values, other.values)):
        num = float((x.float() - y.float()).square().sum())
        den = (
            float((x.float() - kv.keys.float()).square().sum()) + 1e-30
            if x is ref.keys
            else float((x.float() - kv.values.float()).square().sum()) + 1e-30
        )
        assert num <= 1e-2 * den  # a few symbols may round the other way; never a different plan


def test_layer_by_layer_decode_on_gpu_matches_whole_decode(setup):
    _kernels()
    cal, kv = setup
    gpu = Codec(cal, ratio=16, device="cuda", backend=gpu_entropy.NAME)
    blob = gpu.encode(kv)
    whole = gpu.decode(blob, device="cuda")
    for i, (_layer, k, v) in enumerate(gpu.decode_layers(blob, device="cuda")):
        assert k.device.type == "cuda"
        assert torch.allclose(k.float(), whole.keys[:, :, i].float(), atol=1e-2 * float(whole.keys.abs().max()))
        assert torch.allclose(v.float(), whole.values[:, :, i].float(), atol=1e-2 * float(whole.values.abs().max()))


def test_nvcomp_deflate_and_cpu_twin_decode_each_other():
    coder = device_coder(gpu_entropy.NAME, "cuda")
    if coder is None:
        pytest.skip("nvCOMP not installed")
    g = torch.Generator().manual_seed(0)
    sizes = [1, 65536, 65537, 300_000]
    datas = [(torch.randint(0, 4, (n,), generator=g, dtype=torch.uint8) * 17) for n in sizes]
    gpu_streams = coder.compress([d.cuda() for d in datas])
    for d, s in zip(datas, gpu_streams):
        assert gpu_entropy.cpu_decompress(s, d.numel()) == d.numpy().tobytes()
    cpu_streams = [gpu_entropy.cpu_compress(d.numpy().tobytes()) for d in datas]
    back = coder.decompress(cpu_streams, [d.numel() for d in datas])
    for d, t in zip(datas, back):
        assert torch.equal(t.cpu(), d)


def test_precision_bf16_is_close_to_reference(setup):
    _kernels()
    cal, kv = setup
    ref = Codec(cal, ratio=16)
    fast = Codec(cal, ratio=16, device="cuda", precision="bf16", backend=gpu_entropy.NAME)
    a = ref.decode(ref.encode(kv))
    b = fast.decode(fast.encode(_cuda(kv)), device="cuda")
    for x, y, t in ((a.keys, b.keys, kv.keys), (a.values, b.values, kv.values)):
        e_ref = float((x.float() - t.float()).square().sum())
        e_fast = float((y.float().cpu() - t.float()).square().sum())
        assert e_fast <= 1.1 * e_ref + 1e-6 * float(t.float().square().sum())


def test_precision_fp8_is_close_to_reference_and_cpu_decodable(setup):
    _kernels()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    cal, kv = setup
    ref = Codec(cal, ratio=16)
    fast = Codec(cal, ratio=16, device="cuda", precision="fp8")
    a = ref.decode(ref.encode(kv))
    blob = fast.encode(_cuda(kv))
    for b in (fast.decode(blob, device="cuda"), ref.decode(blob)):  # fp8-encoded blobs are ordinary blobs
        for x, y, t in ((a.keys, b.keys, kv.keys), (a.values, b.values, kv.values)):
            e_ref = float((x.float() - t.float()).square().sum())
            e_fast = float((y.float().cpu() - t.float()).square().sum())
            # fp8 operands add about 1e-3 of the signal's energy to the codec's own error
            assert e_fast <= 1.2 * e_ref + 3e-3 * float(t.float().square().sum())


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_direct_decode_with_unaligned_sequence_blocks(setup, precision):
    """Decode writes each sequence's middle tokens straight into the output; with a middle-token count that is
    not a multiple of 4 the second sequence's block starts at an unaligned row (fp8 scales must stay aligned)."""
    _kernels()
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    cal, _ = setup
    layout = cal.layout
    p = layout.num_features
    ks = LowRankSource(p, decay=1e-3, noise=1e-3, seed=13)
    vs = LowRankSource(p, decay=1e-2, noise=1e-3, seed=14)
    kv = make_slice(layout, ks.rows(2 * 701), vs.rows(2 * 701), batch=2)  # 701 - 4 - 128 = 569 middle tokens
    ref = Codec(cal, ratio=16)
    fast = Codec(cal, ratio=16, device="cuda", precision=precision)
    blob = fast.encode(_cuda(kv))
    a = ref.decode(blob)
    b = fast.decode(blob, device="cuda")
    for x, y, t in ((a.keys, b.keys, kv.keys), (a.values, b.values, kv.values)):
        e_ref = float((x.float() - t.float()).square().sum())
        e_fast = float((y.float().cpu() - t.float()).square().sum())
        assert e_fast <= 1.2 * e_ref + 3e-3 * float(t.float().square().sum())


def test_rebuild_cache_on_gpu_equals_cpu_rebuild():
    """rebuild_cache's fused RoPE path on CUDA gives the CPU path's cache (within one bf16 rounding)."""
    _kernels()
    transformers = pytest.importorskip("transformers")
    from kvtc.integrations.hf import extract_slice, rebuild_cache

    cfg = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=100,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 100, (2, 50), device="cuda")
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    kv = extract_slice(cache, model)
    gpu = rebuild_cache(kv, model)
    cpu = rebuild_cache(
        dataclasses.replace(kv, keys=kv.keys.cpu(), values=kv.values.cpu(), positions=kv.positions.cpu()), cfg
    )
    for li in range(3):
        kg, kc = gpu.layers[li].keys, cpu.layers[li].keys
        assert kg.shape == kc.shape
        assert (kg.float().cpu() - kc.float()).abs().max() <= 2**-7 * kc.float().abs().max()
        # and both equal what the model itself cached
        assert (kg.float() - cache.layers[li].keys.float()).abs().max() <= 2**-6 * kc.float().abs().max()


@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_layer_by_layer_rebuild_on_gpu_equals_whole_rebuild(name):
    """rebuild_cache_from_layers on CUDA (RoPE tables made once, before the first layer; one rotary kind, or a
    local and a global one with sliding layers) gives rebuild_cache's cache bit for bit."""
    _kernels()
    pytest.importorskip("transformers")
    import tiny_models
    from kvtc.integrations.hf import extract_slice, rebuild_cache, rebuild_cache_from_layers

    model = tiny_models.build(name, dtype=torch.bfloat16).cuda()
    ids = torch.randint(3, tiny_models.VOCAB, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    kv = extract_slice(cache, model)
    whole = rebuild_cache(kv, model)
    views = ((li, kv.keys[:, :, i], kv.values[:, :, i]) for i, li in enumerate(kv.layout.layers))
    layered = rebuild_cache_from_layers(views, kv.positions, model)
    for li in kv.layout.layers:
        assert layered.layers[li].keys.is_cuda
        assert torch.equal(layered.layers[li].keys, whole.layers[li].keys)
        assert torch.equal(layered.layers[li].values, whole.layers[li].values)
        held = cache.layers[li].keys
        assert (whole.layers[li].keys.float() - held.float()).abs().max() <= 2**-6 * held.float().abs().max()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_restore_path_layers_and_blob_forms_agree(setup, precision):
    """The overlapped restore (huff4k, one PCA group): decode from pinned memory, from bytes and layer by layer give
    the same slice; compress into a pinned buffer gives the bytes compress returns; the CPU decodes it too."""
    _kernels()
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    cal, kv = setup
    fast = Codec(cal, ratio=16, device="cuda", precision=precision, backend="huff4k")
    blob = fast.encode(_cuda(kv))
    buf = torch.empty(len(blob) + 10, dtype=torch.uint8).pin_memory()
    view = fast.encode(_cuda(kv), out=buf)
    assert bytes(view.numpy()) == blob
    whole = fast.decode(view, device="cuda")
    assert torch.equal(whole.keys, fast.decode(blob, device="cuda").keys)
    assert torch.equal(whole.positions.cpu(), kv.positions)
    for i, (_layer, k, v) in enumerate(fast.decode_layers(view, device="cuda")):
        assert torch.equal(k, whole.keys[:, :, i]) and torch.equal(v, whole.values[:, :, i])
    ref = Codec(cal, ratio=16, backend="huff4k").decode(blob)
    for x, y in ((ref.keys, whole.keys), (ref.values, whole.values)):
        assert float((x.float() - y.float().cpu()).square().sum()) <= 3e-3 * float(x.float().square().sum())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_one_bit_plans_code_the_same_on_both_devices(setup, precision):
    """A plan with int1s groups (opt-in type): the GPU's encoder and restore paths (whole, layer by layer, from
    pinned memory) agree with the CPU reference, and the blobs cross devices."""
    _kernels()
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    cal, kv = setup
    plan = Plan(((16, INT4S, 1), (16, INT1S, 3)), clips=(1.0, 0.375, 0.3125, 0.25))
    hand = dataclasses.replace(cal, plans={"8": {"keys": [plan], "values": [plan]}})
    cpu = Codec(hand, ratio=8, backend="huff4k")
    gpu = Codec(hand, ratio=8, device="cuda", precision=precision, backend="huff4k")
    blob_cpu, blob_gpu = cpu.encode(kv), gpu.encode(_cuda(kv))
    ref = cpu.decode(blob_cpu)
    tol = {"fp32": 1e-4, "bf16": 1e-3, "fp8": 2e-2}[precision]
    for blob in (blob_cpu, blob_gpu):
        a = cpu.decode(blob)
        b = gpu.decode(blob, device="cuda")
        for i, (_layer, k, v) in enumerate(gpu.decode_layers(blob, device="cuda")):
            assert torch.equal(k, b.keys[:, :, i]) and torch.equal(v, b.values[:, :, i])
        for x, y, r in ((a.keys, b.keys, ref.keys), (a.values, b.values, ref.values)):
            energy = float(r.float().square().sum())
            assert float((x.float() - y.float().cpu()).square().sum()) <= tol * energy
            assert float((x.float() - r.float()).square().sum()) <= 1e-2 * energy  # same symbols, a few aside


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_fixed_step_plans_code_the_same_on_both_devices(setup, precision):
    """A plan with fixed-step groups (no range parameters; each group's step from the plan): the GPU encoder writes
    blobs the CPU decodes, and every restore path agrees with the CPU decode."""
    _kernels()
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    cal, kv = setup
    plan = Plan(((16, INT4S, 1), (1, INT8F, 4), (1, INT4F, 12), (1, INT2F, 20)),
                clips=(1.0, *[0.01 * 1.3**i for i in range(36)]))  # fmt: skip
    hand = dataclasses.replace(cal, plans={"8": {"keys": [plan], "values": [plan]}})
    cpu = Codec(hand, ratio=8, backend="huff4k")
    gpu = Codec(hand, ratio=8, device="cuda", precision=precision, backend="huff4k")
    blob_cpu, blob_gpu = cpu.encode(kv), gpu.encode(_cuda(kv))
    ref = cpu.decode(blob_cpu)
    tol = {"fp32": 1e-4, "bf16": 1e-3, "fp8": 2e-2}[precision]
    for blob in (blob_cpu, blob_gpu):
        a = cpu.decode(blob)
        b = gpu.decode(blob, device="cuda")
        for i, (_layer, k, v) in enumerate(gpu.decode_layers(blob, device="cuda")):
            assert torch.equal(k, b.keys[:, :, i]) and torch.equal(v, b.values[:, :, i])
        for x, y, r in ((a.keys, b.keys, ref.keys), (a.values, b.values, ref.values)):
            energy = float(r.float().square().sum())
            assert float((x.float() - y.float().cpu()).square().sum()) <= tol * energy


def test_cpu_blobs_with_gauss_planes_decode_the_same_on_the_gpu(setup):
    """The CPU encoder's default coders (fixed-step planes under their Gaussians, delta-coded positions): a GPU
    codec decodes such a blob (those sections on the host) to what the CPU decodes."""
    from kvtc.coding import gaussian

    _kernels()
    if not gaussian.available():
        pytest.skip("constriction is not installed")
    cal, kv = setup
    plan = Plan(((16, INT4S, 1), (1, INT8F, 4), (1, INT4F, 12), (1, INT2F, 20)),
                clips=(1.0, *[0.01 * 1.3**i for i in range(36)]))  # fmt: skip
    hand = dataclasses.replace(cal, plans={"8": {"keys": [plan], "values": [plan]}})
    blob = Codec(hand, ratio=8).encode(kv)
    backends = {s["backend"] for s in Codec.inspect(blob)["sections"]}
    assert "gauss" in backends and "zstd-delta64" in backends
    a = Codec(hand, ratio=8).decode(blob)
    b = Codec(hand, ratio=8, device="cuda").decode(blob, device="cuda")
    for x, y in ((a.keys, b.keys), (a.values, b.values), (a.positions, b.positions)):
        energy = max(float(x.float().square().sum()), 1.0)
        assert float((x.float() - y.float().cpu()).square().sum()) <= 1e-4 * energy


def test_gpu_restore_path_refuses_corrupt_blobs(setup):
    """A flipped byte fails the section's CRC-32; a flipped byte with its CRC-32 fixed fails the entropy decode's
    device check: both FormatError, from decode and from decode_layers before the first layer."""
    import zlib

    from kvtc.codec import container
    from kvtc.errors import FormatError

    _kernels()
    cal, kv = setup
    fast = Codec(cal, ratio=16, device="cuda", backend="huff4k")
    blob = bytearray(fast.encode(_cuda(kv)))
    header, body = container.read_header(blob)
    off = body
    for s in header.sections:
        if s.name.startswith("values.") and s.backend == "huff4k" and s.coded > 4096:
            break
        off += s.coded
    else:
        pytest.skip("no coded values stream of more than one block")
    bad = bytearray(blob)
    bad[off + s.coded - 1] ^= 0x80  # the stream's last word: its padding bits (or its last code)
    with pytest.raises(FormatError, match="checksum"):
        fast.decode(bytes(bad), device="cuda")
    # the same flip with the checksum made to match: only the decoder can tell
    s.crc32 = zlib.crc32(bytes(bad[off : off + s.coded]))
    pre = container.prefix_and_header(header)
    if len(pre) != body:
        pytest.skip("the fixed checksum has another digit count")
    forged = bytearray(bad)
    forged[:body] = pre
    with pytest.raises(FormatError):
        fast.decode(bytes(forged), device="cuda")
    with pytest.raises(FormatError):
        next(iter(fast.decode_layers(bytes(forged), device="cuda")))


def test_fp8_operand_kernels_match_torch():
    kernels = _kernels()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(3, 300, 384, device="cuda", generator=g) * 20).to(torch.bfloat16)
    mean, inv = torch.randn(384, device="cuda", generator=g), torch.rand(384, device="cuda", generator=g) * 3
    got = kernels.rows_to_fp8(x[:, 7:290], mean, inv)
    want = ((x[:, 7:290].float() - mean) * inv).clamp(-448, 448).reshape(-1, 384).to(torch.float8_e4m3fn)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
