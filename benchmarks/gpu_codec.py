"""GPU codec benchmark: throughput, roofline, time-to-first-token and GPU calibration on one GPU.

Models are random-weight (bf16) builds of real configs (speed does not depend on the weights); each gets a
calibration fitted on its own pre-RoPE KV. Per model: 8 sequences x 8,192 tokens at the target ratio.

* compress: KV slice on the GPU (pre-RoPE keys, bf16) -> blob (bytes) in host memory, end to end: projection,
  fused quantize+pack, GPU entropy coding (huff4k, ours; nvCOMP's DEFLATE where Triton is missing), device->host
  copy of the coded streams, container assembly (CRC-32 of every section on host threads, the join).
* decompress: blob in pinned host memory -> KV slice on the GPU: container parse, host->device copy of the coded
  streams, GPU entropy decode, fused unpack+dequantize, reconstruction; the CRC-32s run on host threads meanwhile
  and are checked before the slice is returned. Also from a plain ``bytes`` blob (staged through pinned memory).
* TTFT: blob in pinned host memory -> decompress -> RoPE re-applied into a DynamicCache (fused kernel) -> one
  decoding step, against recomputing the prefill of the same 8,192-token prefixes (both end with the first new
  token). Precisions: bf16 and fp8 projections; TTFT uses fp8 where the GPU has it.
* ceilings: device-to-device copy bandwidth and bf16 matrix rate, measured in the same run.

``python benchmarks/gpu_codec.py --out results.json [--quick] [--models llama,nemo] [--calib-samples N]``
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvtc import __version__  # noqa: E402
from kvtc.calibration import Recipe, fit_calibration  # noqa: E402
from kvtc.codec import Codec  # noqa: E402
from kvtc.codec import nvcomp as gpu_entropy  # noqa: E402
from kvtc.codec.entropy import device_coder as _device_coder  # noqa: E402


def gpu_backend() -> str:
    """The fastest entropy backend with a GPU coder here: huff4k (ours), else nvCOMP's chunked DEFLATE."""
    for name in ("huff4k", gpu_entropy.NAME):
        if _device_coder(name, torch.device("cuda")) is not None:
            return name
    return gpu_entropy.NAME


CONFIGS = {
    # the real configs' shapes (Llama-3.1-8B, Mistral-NeMo-12B)
    "llama-3.1-8b": dict(
        arch="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "mistral-nemo-12b": dict(
        arch="mistral",
        hidden_size=5120,
        intermediate_size=14336,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=131072,
        rope_theta=1000000.0,
        max_position_embeddings=1024000,
        rms_norm_eps=1e-5,
    ),
    "tiny": dict(
        arch="llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
}


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn, reps: int = 3):
    """(median seconds, last result) of ``fn`` after one warm-up."""
    out = fn()
    sync()
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2], out


def ceilings() -> dict:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    t, _ = timed(lambda: b.copy_(a), reps=10)
    copy = 2 * n / t
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t, _ = timed(lambda: x @ y, reps=10)
    mm = 2 * m**3 / t
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    t, _ = timed(lambda: h.copy_(a, non_blocking=True), reps=5)
    d2h = n / t
    t, _ = timed(lambda: a.copy_(h, non_blocking=True), reps=5)
    h2d = n / t
    del a, b, x, y, h
    torch.cuda.empty_cache()
    return {
        "copy_GBps": copy / 1e9,
        "bf16_mm_TFLOPs": mm / 1e12,
        "d2h_pinned_GBps": d2h / 1e9,
        "h2d_pinned_GBps": h2d / 1e9,
    }


def build_model(name: str):
    import transformers

    cfg = dict(CONFIGS[name])
    arch = cfg.pop("arch")
    Config = transformers.LlamaConfig if arch == "llama" else transformers.MistralConfig
    config = Config(**cfg, dtype="bfloat16", attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    return model


@torch.no_grad()
def prefill_kv(model, ids: torch.Tensor):
    from transformers import DynamicCache

    from kvtc.integrations.hf import extract_slice

    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return extract_slice(cache, model), out.logits[:, -1].argmax(-1)


@torch.no_grad()
def calibrate(model, name: str, samples: int, rank: int, ratios, seq: int, batch: int, say) -> tuple:
    """Calibration rows from the model's own KV (kept on the GPU in bf16), then GPU randomized PCA + DP."""
    from kvtc.integrations.hf import describe_model

    layout, spec = describe_model(model)
    vocab = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(1)
    krows, vrows = [], []
    t0 = time.perf_counter()
    n = 0
    while n < samples:
        ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)
        kv, _ = prefill_kv(model, ids)
        krows.append(kv.keys[:, 4:].reshape(-1, layout.num_features).contiguous())
        vrows.append(kv.values[:, 4:].reshape(-1, layout.num_features).contiguous())
        n += krows[-1].shape[0]
        del kv
    sync()
    t_collect = time.perf_counter() - t0
    chunk = 8192

    kall = torch.cat(krows)[:samples]
    krows.clear()
    vall = torch.cat(vrows)[:samples]
    vrows.clear()

    def source():
        return ((kall[i : i + chunk], vall[i : i + chunk]) for i in range(0, kall.shape[0], chunk))

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # randomized PCA's passes in TF32
    try:
        cal = fit_calibration(
            layout,
            source,
            Recipe(ratios=ratios, rank_cap=rank, method="randomized"),
            device="cuda",
            rope=spec.to_dict(),
            model_id=name,
            progress=say,
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    sync()
    t_fit = time.perf_counter() - t0
    return cal, {
        "samples": samples,
        "p": layout.num_features,
        "rank_cap": rank,
        "ratios": list(ratios),
        "collect_s": t_collect,
        "fit_s": t_fit,
        "fit_stage_s": cal.stats.get("seconds"),
        "peak_gpu_GiB": torch.cuda.max_memory_allocated() / 2**30,
        "kept_components": {k: [p.basis.shape[0] for p in cal.pcas[k]] for k in ("keys", "values")},
    }


def plan_flops(codec: Codec, n: int) -> float:
    """Matrix FLOPs of one projection pass (keys and values): 2 n p k per kind."""
    tot = 0.0
    for _kind, pls in codec._plans.items():
        for g, pl in enumerate(pls):
            p = codec.calibration.columns[g].numel()
            tot += 2.0 * n * p * pl.components
    return tot


@torch.no_grad()
def bench_codec(model, name: str, cal, ratio: float, batch: int, seq: int, ceil: dict, say) -> dict:
    from kvtc.integrations.hf import rebuild_cache

    vocab = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(7)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)

    def recompute():
        from transformers import DynamicCache

        out = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1)

    t_recompute, tok_ref = timed(recompute, reps=2)
    kv, _ = prefill_kv(model, ids)
    kv_bytes = 2 * kv.keys.numel() * kv.keys.element_size()
    res = {"model": name, "batch": batch, "tokens": seq, "ratio": ratio, "kv_GB": kv_bytes / 1e9}
    backend = gpu_backend()
    res["backend"] = backend
    for precision in ("bf16", "fp8"):
        try:
            codec = Codec(cal, ratio=ratio, device="cuda", precision=precision, backend=backend)
            t_enc, blob = timed(lambda: codec.encode(kv), reps=3)
            # what an offload tier does: encode into a pinned host buffer it keeps and reuses (no fresh pages)
            pbuf = torch.empty(len(blob) + (1 << 20), dtype=torch.uint8, pin_memory=True)
            t_enc_into, _ = timed(lambda: codec.encode(kv, out=pbuf), reps=3)
            # the blob held in pinned host memory (what an offload tier keeps); decoding bytes needs a staging copy
            pblob = torch.frombuffer(bytearray(blob), dtype=torch.uint8).pin_memory()
            t_dec, out = timed(lambda: codec.decode(pblob, device="cuda"), reps=3)
            t_dec_bytes, _ = timed(lambda: codec.decode(blob, device="cuda"), reps=2)
            st_e, st_d = {}, {}
            coder = _device_coder(backend, torch.device("cuda"))
            codec.encode(kv, timings=st_e)
            st_e.update({f"coder.{k}": v for k, v in getattr(coder, "last", {}).items()})
            codec.decode(pblob, timings=st_d, device="cuda")
            st_d.update({f"coder.{k}": v for k, v in getattr(coder, "last", {}).items()})
            info = Codec.inspect(blob)
            n_mid = batch * info["middle_tokens"]
            flops = plan_flops(codec, n_mid)
            t_proj_e, t_proj_d = st_e.get("project", 0.0), st_d.get("project", 0.0)
            err = {}
            for kind, a, b in (("keys", kv.keys, out.keys), ("values", kv.values, out.values)):
                a32, b32 = a.float(), b.float()
                err[kind] = float((a32 - b32).square().sum() / a32.square().sum())
                del a32, b32
            r = {
                "compress_s": t_enc,
                "decompress_s": t_dec,
                "compress_GBps": kv_bytes / t_enc / 1e9,
                "decompress_GBps": kv_bytes / t_dec / 1e9,
                "compress_into_pinned_s": t_enc_into,
                "compress_into_pinned_GBps": kv_bytes / t_enc_into / 1e9,
                "decompress_from_bytes_s": t_dec_bytes,
                "decompress_from_bytes_GBps": kv_bytes / t_dec_bytes / 1e9,
                "compress_stages_s": st_e,
                "decompress_stages_s": st_d,
                "blob_MB": len(blob) / 1e6,
                "codec_ratio": info["codec_ratio"],
                "whole_cache_ratio": info["whole_cache_ratio"],
                "relative_sq_error": err,
                "projection_TFLOP": flops / 1e12,
                "projection_TFLOPs_achieved": {
                    "encode": flops / max(t_proj_e, 1e-9) / 1e12,
                    "decode": flops / max(t_proj_d, 1e-9) / 1e12,
                },
                "roofline_s": {
                    "matmul_at_measured_bf16_rate": flops / (ceil["bf16_mm_TFLOPs"] * 1e12),
                    "kv_read_once_at_copy_bw": kv_bytes / (ceil["copy_GBps"] * 1e9),
                    "coded_d2h_at_pinned_bw": len(blob) / (ceil["d2h_pinned_GBps"] * 1e9),
                },
            }
            res[precision] = r
            del pbuf
            say(
                f"{name} {precision}: compress {r['compress_GBps']:.1f} GB/s (into pinned {r['compress_into_pinned_GBps']:.1f}) "
                f"decompress {r['decompress_GBps']:.1f} GB/s "
                f"ratio {r['codec_ratio']:.2f} stages e={ {k: round(v * 1e3, 1) for k, v in st_e.items()} } "
                f"d={ {k: round(v * 1e3, 1) for k, v in st_d.items()} }"
            )
            del out
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - keep the other measurements
            import traceback

            traceback.print_exc()
            res[precision] = {"error": repr(e)}
    ttft_precision = "fp8" if "error" not in res.get("fp8", {"error": 1}) else "bf16"
    codec = Codec(cal, ratio=ratio, device="cuda", precision=ttft_precision, backend=backend)
    # The cache holds the prefix (all tokens but the last); feeding the last token predicts what recomputing the
    # whole prefill predicts, so the first tokens can be compared.
    del kv
    torch.cuda.empty_cache()
    kv, _ = prefill_kv(model, ids[:, :-1])
    blob = torch.frombuffer(bytearray(codec.encode(kv)), dtype=torch.uint8).pin_memory()  # held in host memory
    last = ids[:, -1:]
    pos = torch.full((batch, 1), seq - 1, device="cuda", dtype=torch.long)
    stages: dict[str, float] = {}

    def from_blob(record: bool = False):
        t0 = time.perf_counter()
        rec = codec.decode(blob, device="cuda")
        if record:
            sync()
            t1 = time.perf_counter()
        cache = rebuild_cache(rec, model)
        if record:
            sync()
            t2 = time.perf_counter()
        o = model(input_ids=last, past_key_values=cache, position_ids=pos, use_cache=True)
        tok = o.logits[:, -1].argmax(-1)
        if record:
            sync()
            stages.update(decode_s=t1 - t0, rebuild_cache_s=t2 - t1, first_token_s=time.perf_counter() - t2)
        return tok

    def from_raw():  # upper bound: the uncompressed KV already on the GPU
        cache = rebuild_cache(kv, model)
        o = model(input_ids=last, past_key_values=cache, position_ids=pos, use_cache=True)
        return o.logits[:, -1].argmax(-1)

    t_ttft, tok_blob = timed(from_blob, reps=3)
    from_blob(record=True)
    t_raw, tok_raw = timed(from_raw, reps=3)
    res["ttft"] = {
        "precision": ttft_precision,
        "recompute_prefill_s": t_recompute,
        "from_compressed_host_blob_s": t_ttft,
        "speedup": t_recompute / t_ttft,
        "from_uncompressed_gpu_kv_s": t_raw,
        "stages_s": stages,
        "blob_MB": blob.numel() / 1e6,
        "first_token_agrees_with_recompute": int((tok_blob == tok_ref).sum()) / batch,
        "raw_first_token_agrees_with_recompute": int((tok_raw == tok_ref).sum()) / batch,
    }
    say(
        f"{name} TTFT: recompute {t_recompute * 1e3:.0f} ms, from blob {t_ttft * 1e3:.0f} ms "
        f"({t_recompute / t_ttft:.1f}x), raw-on-GPU {t_raw * 1e3:.0f} ms"
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_codec.json"))
    ap.add_argument("--models", default="llama-3.1-8b")
    ap.add_argument("--quick", action="store_true", help="tiny model, short sequences (a smoke test)")
    ap.add_argument("--calib-samples", type=int, default=160 * 1024)
    ap.add_argument("--rank", type=int, default=10_000)
    ap.add_argument("--ratio", type=float, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    t_start = time.time()

    def say(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    import transformers
    import triton

    result = {
        "command": " ".join(["python", "benchmarks/gpu_codec.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "kvtc": __version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
            "nvcomp": getattr(gpu_entropy._nvcomp(), "__version__", None),
            "python": platform.python_version(),
        },
        "models": {},
    }
    result["ceilings"] = ceilings()
    say(f"ceilings {result['ceilings']}")
    models = ["tiny"] if args.quick else args.models.split(",")
    for name in models:
        model = build_model(name)
        quick = args.quick
        samples = 16384 if quick else args.calib_samples
        rank = 256 if quick else args.rank
        seq = 2048 if quick else args.tokens
        cal_batch = 4 if quick else 2
        ratios = (8, 16, 32, 64)
        say(f"{name}: calibrating on {samples} samples, rank cap {rank}")
        cal, cstats = calibrate(
            model, name, samples, rank, ratios, seq=8192 if not quick else 2048, batch=cal_batch, say=say
        )
        say(
            f"{name}: calibration {cstats['fit_s']:.1f}s peak {cstats['peak_gpu_GiB']:.1f} GiB kept {cstats['kept_components']}"
        )
        torch.cuda.empty_cache()
        result["models"][name] = {"calibration": cstats}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=float))
        r = bench_codec(model, name, cal, args.ratio, args.batch if not quick else 2, seq, result["ceilings"], say)
        r["calibration"] = cstats
        result["models"][name] = r
        del model, cal
        torch.cuda.empty_cache()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=float))
    say("done")


if __name__ == "__main__":
    main()
