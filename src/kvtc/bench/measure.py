"""The measurements of ``kvtc bench``: prefill per context, then per ratio (and projection precision on a GPU)
encode, decode into the model's cache, and the blob's sizes.

Every time is the median of repetitions, each bracketed by a device synchronisation (on CUDA) and read with
``time.perf_counter``; GPU codecs and prefills get one untimed warm-up first (kernel compilation, allocator), CPU
ones none beyond one short warm-up forward pass before the first context. Decode means what an engine must do
before the first new token: blob -> :class:`~kvtc.layout.KVSlice` -> the model's ``DynamicCache`` with RoPE
re-applied (CPU: ``Codec.decode`` then ``rebuild_cache``; CUDA: ``Codec.decode_layers`` from a blob in pinned host
memory into ``rebuild_cache_from_layers``, layer by layer as an engine restores).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..progress import StageTimer, bar
from .model import Loaded, context_ids, sync


@dataclass(frozen=True)
class Plan:
    """What one run measures, and how many times."""

    contexts: tuple[int, ...]
    ratios: tuple[float, ...]
    precisions: tuple[str, ...]
    backend: str
    prefill_reps: int
    encode_reps: int
    decode_reps: int
    warmup: int  # untimed runs before each timed series (GPU: 1, CPU: 0)


def timed(fn: Callable[[], Any], reps: int, warmup: int, device: Any) -> tuple[float, list[float], Any]:
    """``(median seconds, every run's seconds, the last result)`` of ``fn`` over ``reps`` runs after ``warmup``
    untimed ones, the device synchronised before and after each run."""
    out = None
    for _ in range(warmup):
        out = fn()
    runs = []
    for _ in range(max(reps, 1)):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), runs, out


def gpu_precisions(device: Any) -> tuple[tuple[str, ...], dict[str, str]]:
    """The projection precisions a GPU codec offers here (bf16; fp8 from compute capability 8.9) and why any is
    left out."""
    import torch

    if torch.cuda.get_device_capability(device) >= (8, 9):
        return ("bf16", "fp8"), {}
    return ("bf16",), {"fp8": "needs a GPU with fp8 tensor cores (compute capability 8.9 or newer)"}


def gpu_backend(device: Any) -> str:
    """The entropy backend with a GPU coder here (huff4k, else nvCOMP's deflate64k), else the CPU default."""
    from ..coding.entropy import DEFAULT_BACKEND, device_coder

    for name in ("huff4k", "deflate64k"):
        if device_coder(name, device) is not None:
            return name
    return DEFAULT_BACKEND


def run(loaded: Loaded, plan: Plan, device: Any, progress: bool, timer: StageTimer) -> dict[str, Any]:
    """Measure ``plan`` on ``loaded``: ``{"prefill": [...], "codec": [...]}``, one row per context and one per
    (context, ratio, precision)."""
    import torch
    from transformers import DynamicCache

    from ..codec import Codec
    from ..integrations.hf import extract_slice

    model, cal = loaded.model, loaded.calibration
    emb = model.get_input_embeddings().weight if cal.token_map is not None else None
    codecs = {
        (r, p): Codec(cal, ratio=r, device=device, precision=p, backend=plan.backend, embeddings=emb)
        for r in plan.ratios
        for p in plan.precisions
    }
    prefill_rows: list[dict[str, Any]] = []
    codec_rows: list[dict[str, Any]] = []
    steps = len(plan.contexts) * (1 + 2 * len(codecs))
    with bar(steps, "kvtc bench", progress, unit="step") as tick, torch.inference_mode():
        warm = context_ids(loaded, min(64, plan.contexts[0]), device, seed=1)
        model(input_ids=warm, use_cache=True, logits_to_keep=1)  # first-call costs out of the first prefill
        for n in plan.contexts:
            ids = context_ids(loaded, n, device)

            def prefill(ids: Any = ids) -> Any:
                cache = DynamicCache(config=model.config)
                model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                return cache

            with timer("prefill"):
                t_pre, runs, cache = timed(prefill, plan.prefill_reps, plan.warmup, device)
            kv = extract_slice(cache, model)
            kv.keys, kv.values = kv.keys.to(torch.bfloat16), kv.values.to(torch.bfloat16)  # 16-bit, as stored
            kv.layout = _bf16(kv.layout)
            with timer("first_step"):
                t_step = _first_step(model, cache, ids, plan.warmup, device)
            del cache
            prefill_rows.append(
                {
                    "context": n,
                    "prefill_s": t_pre,
                    "prefill_runs_s": runs,
                    "first_step_s": t_step,
                    "tokens_per_s": n / t_pre,
                }
            )
            tick(1)
            for (ratio, precision), codec in codecs.items():
                row = _codec_row(codec, kv, ids, model, plan, device, timer, tick)
                codec_rows.append({"context": n, "ratio": ratio, "precision": precision, **row})
            del kv
            _free(device)
    return {"prefill": prefill_rows, "codec": codec_rows}


def _bf16(layout: Any) -> Any:
    import dataclasses

    return dataclasses.replace(layout, dtype="bfloat16")


def _first_step(model: Any, cache: Any, ids: Any, warmup: int, device: Any) -> float:
    """Seconds of one token's forward step against the context's cache (the step every path ends with); each run
    adds a token to ``cache``, which is dropped afterwards."""
    step = lambda: model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return timed(step, 1, warmup, device)[0]


def _codec_row(
    codec: Any, kv: Any, ids: Any, model: Any, plan: Plan, device: Any, timer: StageTimer, tick: Callable[[int], None]
) -> dict[str, Any]:
    import torch

    from ..codec import Codec
    from ..integrations.hf import rebuild_cache, rebuild_cache_from_layers

    ids = ids.cpu()  # where the encoder reads them (a token map's ids go into the blob)
    with timer("encode"):
        t_enc, enc_runs, blob = timed(lambda: codec.encode(kv, token_ids=ids), plan.encode_reps, plan.warmup, device)
    tick(1)
    info = Codec.inspect(blob)
    if device.type == "cuda":
        held = torch.frombuffer(bytearray(blob), dtype=torch.uint8).pin_memory()  # what an offload tier keeps
        positions = kv.positions

        def restore() -> Any:
            return rebuild_cache_from_layers(codec.decode_layers(held, device=device), positions, model)

    else:

        def restore() -> Any:
            return rebuild_cache(codec.decode(blob), model)

    with timer("decode"):
        t_dec, dec_runs, _ = timed(restore, plan.decode_reps, plan.warmup, device)
    tick(1)
    raw, stored = int(info["original_bytes"]), len(blob)
    return {
        "backend": codec.backend,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "codec_ratio": info["codec_ratio"],
        "encode_s": t_enc,
        "encode_runs_s": enc_runs,
        "encode_GBps": raw / t_enc / 1e9,
        "decode_s": t_dec,
        "decode_runs_s": dec_runs,
        "decode_GBps": raw / t_dec / 1e9,
    }


def _free(device: Any) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
