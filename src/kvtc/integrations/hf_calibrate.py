"""Calibrate any Hugging Face causal LM: run it over a corpus, collect pre-RoPE keys and values, fit.

Sampling follows the paper: documents are cut into windows (default 1,024 tokens), the model is run over each
window, the first ``sinks`` positions of every window are excluded (attention sinks are never compressed, so they
must not shape the basis), and every other position becomes one calibration row. Windows are drawn across the
whole corpus (``sampling="spread"``, the default: seeded, round-robin over as many documents as possible), not
from its first documents (``"first"``): a corpus sorted by date or topic would otherwise calibrate on one corner
of it.
Rows stream into the PCA accumulators window by window, so memory is ``O(p²)`` whatever the token count.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ..calibration import Calibration, fit_calibration
from ..calibration.fit import DEFAULT_RATIOS, DEFAULT_SENSITIVITY_FLOOR, sensitivity_scales
from ..codec import DEFAULT_SINKS, DEFAULT_WINDOW
from ..errors import CalibrationError
from ..layout import KVSlice, PCAGrouping
from .hf import describe_model, extract_slice, rebuild_cache

log = logging.getLogger(__name__)

#: tokens per calibration window (the paper used documents of 1K–32K tokens)
DEFAULT_WINDOW_TOKENS = 1024
#: calibration size of the embedded default (the paper used ~160K tokens for 8B models)
DEFAULT_TOKENS = 100_000
#: names the fitting recipe of the cached default calibration (ratio grid, K/V split, sensitivity weighting,
#: quantization types, sampling); a new recipe is a new file. r8: windows spread across the corpus, Fisher-weighted
#: per feature (each kind normalised apart), every quantization type with the DP's clips, targets 6-64 with 7.5
#: and 10 between; r8u: the same without weighting (``sensitivity="none"``). r7 took the corpus's first windows.
DEFAULT_RECIPE = "r8"
UNWEIGHTED_RECIPE = "r8u"
#: how the PCA weighs features: "fisher" (ours: by the loss's measured sensitivity) or "none" (the paper's plain
#: squared error)
SENSITIVITIES = ("fisher", "none")
DEFAULT_SENSITIVITY = "fisher"
#: windows of the calibration corpus whose loss gradients measure the sensitivity, and their shape
DEFAULT_SENSITIVITY_WINDOWS = 8
#: one weight per feature: on SmolLM2-135M it gave the least next-token KL of per-feature and per-(layer, head)
#: weights (BENCHMARKS.md, "Sensitivity weighting")
DEFAULT_SENSITIVITY_RESOLUTION = "feature"
#: the labels whose loss gradients are measured: "text" (the empirical Fisher) or "model" (sampled: true Fisher)
DEFAULT_SENSITIVITY_LABELS = "text"
SENSITIVITY_CONTEXT = 2048
SENSITIVITY_CONTINUATION = 256
#: how calibration windows are taken from the corpus: "spread" (seeded windows across all documents, round-robin
#: over them) or "first" (consecutive windows from the first documents on)
SAMPLINGS = ("spread", "first")
DEFAULT_SAMPLING = "spread"


def token_windows(tokenizer: Any, texts: Sequence[str], window: int, limit_windows: int | None = None) -> Iterator[torch.Tensor]:
    """Consecutive ``window``-token pieces of each document (documents shorter than a window are joined
    with the next ones, separated by the EOS token)."""
    carry: list[int] = []
    produced = 0
    eos = tokenizer.eos_token_id
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        carry.extend(ids)
        if eos is not None:
            carry.append(eos)
        while len(carry) >= window:
            yield torch.tensor(carry[:window], dtype=torch.int64)
            carry = carry[window:]
            produced += 1
            if limit_windows is not None and produced >= limit_windows:
                return
    # the remainder is dropped: a short tail would over-weight early positions


def corpus_windows(tokenizer: Any, texts: Sequence[str], window: int, count: int, sampling: str = DEFAULT_SAMPLING,
                   seed: int = 0) -> Iterator[torch.Tensor]:
    """``count`` windows of ``window`` token ids from ``texts``, as ``sampling`` takes them (:data:`SAMPLINGS`);
    fewer only with ``sampling="first"`` when the texts run out (the callers say so)."""
    if sampling not in SAMPLINGS:
        raise CalibrationError(f"unknown sampling {sampling!r}; use one of {', '.join(SAMPLINGS)}")
    if sampling == "first":
        yield from token_windows(tokenizer, texts, window, count)
        return
    from .. import assets
    from ..errors import KVTCError

    try:
        ids = assets.iter_token_windows(tokenizer, texts, window, count, seed=seed)  # bounded memory
    except KVTCError as e:
        raise CalibrationError(
            f"the corpus holds fewer than {count} windows of {window} tokens ({e}); add more text or ask for fewer tokens"
        ) from None
    yield from ids


def collect_rows(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    tokens: int,
    window: int = DEFAULT_WINDOW_TOKENS,
    sinks: int = DEFAULT_SINKS,
    progress: bool = True,
    sampling: str = DEFAULT_SAMPLING,
    seed: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(key_rows, value_rows)`` float32 ``[window - sinks, p]`` per window until ``tokens`` rows, the
    windows taken from ``texts`` as ``sampling`` says (:func:`corpus_windows`)."""
    from transformers import DynamicCache

    if window <= sinks:
        raise CalibrationError(f"calibration window ({window}) must be longer than the sinks ({sinks})")
    layout, _ = describe_model(model)
    device = next(model.parameters()).device
    bar = _bar(tokens, "calibration tokens", progress)
    done = 0
    try:
        count = -(-tokens // (window - sinks))
        for ids in corpus_windows(tokenizer, texts, window, count, sampling, seed):
            with torch.inference_mode():
                # a config-less cache keeps every token of sliding-window layers too
                cache = DynamicCache()
                model(input_ids=ids[None].to(device), past_key_values=cache, use_cache=True)
            kv = extract_slice(cache, model)
            take = min(window - sinks, tokens - done)
            k = kv.keys[0, sinks : sinks + take].reshape(take, layout.num_features).float().cpu()
            v = kv.values[0, sinks : sinks + take].reshape(take, layout.num_features).float().cpu()
            done += take
            bar.update(take)
            yield k, v
            if done >= tokens:
                return
    finally:
        bar.close()
    if done < tokens:
        raise CalibrationError(
            f"the corpus gave only {done} calibration tokens of the {tokens} asked for; "
            "add more text or ask for fewer tokens"
        )


def measure_sensitivity(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    windows: int = DEFAULT_SENSITIVITY_WINDOWS,
    context: int = SENSITIVITY_CONTEXT,
    continuation: int = SENSITIVITY_CONTINUATION,
    sinks: int = DEFAULT_SINKS,
    recent: int = DEFAULT_WINDOW,
    progress: bool = True,
    labels: str = "text",
    seed: int = 0,
    sampling: str = DEFAULT_SAMPLING,
) -> dict[str, torch.Tensor]:
    """How much the model's loss feels each cached feature: ``{"keys": [p], "values": [p]}`` float32, the mean
    squared gradient of the next-token loss with respect to the pre-RoPE keys and the values of a cache.

    For each of ``windows`` windows of ``texts``: prefill ``context`` tokens, put that cache back with its keys
    and values as leaves (RoPE re-applied by :func:`rebuild_cache`, so key gradients are pre-RoPE), teacher-force
    the next ``continuation`` tokens and backpropagate their summed negative log-likelihood. Only the positions a
    codec compresses count: past the ``sinks``, before the ``recent`` raw window. The squared gradient is the
    diagonal of the Fisher information: a small error ``δ`` costs about ``½ Σ F·δ²`` nats of KL.

    ``labels="text"`` scores the text's own next tokens (the empirical Fisher); ``"model"`` draws each position's
    label from the model's own next-token distribution (an unbiased one-sample estimate of the true Fisher).
    The windows are taken as ``sampling`` says (:func:`corpus_windows`, seeded with ``seed + 1``).
    """
    if labels not in ("text", "model"):
        raise CalibrationError(f"labels must be 'text' or 'model', got {labels!r}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    from transformers import DynamicCache

    if context <= sinks + recent or continuation < 1:
        raise CalibrationError(f"sensitivity context ({context}) must exceed sinks + recent window ({sinks + recent})")
    layout, _ = describe_model(model)
    device = next(model.parameters()).device
    sums = {kind: torch.zeros(layout.num_features, dtype=torch.float64) for kind in ("keys", "values")}
    count = 0
    flags = [p.requires_grad for p in model.parameters()]
    bar = _bar(windows, "sensitivity windows", progress)
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for ids in corpus_windows(tokenizer, texts, context + continuation + 1, windows, sampling, seed + 1):
            ids = ids.to(device)
            with torch.inference_mode():
                cache = DynamicCache(config=model.config)
                model(input_ids=ids[None, :context], past_key_values=cache, use_cache=True)
            kv = extract_slice(cache, model)
            with torch.enable_grad():
                k = kv.keys.clone().float().requires_grad_(True)
                v = kv.values.clone().float().requires_grad_(True)
                lossy = rebuild_cache(KVSlice(kv.layout, k, v, kv.positions.clone(), kv.model_id), model,
                                      linear_states=cache)
                del cache
                logits = model(input_ids=ids[None, context:-1], past_key_values=lossy, use_cache=True).logits[0]
                target = ids[context + 1 :]
                if labels == "model":
                    probs = torch.softmax(logits.detach().float(), dim=-1).cpu()
                    target = torch.multinomial(probs, 1, generator=gen)[:, 0].to(device)
                loss = torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum")
                loss.backward()
            for kind, t in (("keys", k), ("values", v)):
                g = t.grad[0, sinks : context - recent].reshape(-1, layout.num_features)
                sums[kind] += g.double().square().sum(0).cpu()
            count += context - recent - sinks
            bar.update(1)
    finally:
        bar.close()
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
    if count == 0:
        raise CalibrationError(
            f"the corpus has no window of {context + continuation + 1} tokens to measure sensitivity on; "
            "add longer documents or calibrate with sensitivity='none'"
        )
    return {kind: (t / count).float() for kind, t in sums.items()}


def calibrate_model(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    tokens: int = DEFAULT_TOKENS,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    window: int = DEFAULT_WINDOW_TOKENS,
    sinks: int = DEFAULT_SINKS,
    grouping: PCAGrouping = PCAGrouping(),
    model_id: str = "",
    corpus: dict[str, Any] | None = None,
    progress: bool = True,
    sensitivity: str = DEFAULT_SENSITIVITY,
    sensitivity_windows: int = DEFAULT_SENSITIVITY_WINDOWS,
    sensitivity_floor: float = DEFAULT_SENSITIVITY_FLOOR,
    sensitivity_resolution: str = DEFAULT_SENSITIVITY_RESOLUTION,
    sensitivity_labels: str = DEFAULT_SENSITIVITY_LABELS,
    sampling: str = DEFAULT_SAMPLING,
    **fit_kwargs: Any,
) -> Calibration:
    """Calibration of ``model`` on ``texts``: pre-RoPE PCA bases and a DP bit plan per ratio.

    ``tokens`` calibration rows are taken from windows of ``window`` tokens, the first ``sinks`` positions of
    each excluded, drawn across the corpus (``sampling="spread"``) or from its start (``"first"``). The model's
    RoPE spec is stored in the calibration and checked whenever it is used.

    ``sensitivity="fisher"`` (default; ours) first measures the loss's sensitivity to every cached feature on
    ``sensitivity_windows`` windows of the same texts (:func:`measure_sensitivity`) and fits on rows weighted by
    it, one weight per feature (``sensitivity_resolution="head"``: per (layer, KV head)), floored at
    ``sensitivity_floor`` of the mean (:func:`~kvtc.calibration.fit.sensitivity_scales`); ``"none"`` fits the
    paper's plain squared error.
    """
    if sensitivity not in SENSITIVITIES:
        raise CalibrationError(f"unknown sensitivity {sensitivity!r}; use one of {', '.join(SENSITIVITIES)}")
    if sampling not in SAMPLINGS:
        raise CalibrationError(f"unknown sampling {sampling!r}; use one of {', '.join(SAMPLINGS)}")
    layout, rope = describe_model(model)
    t0 = time.perf_counter()
    meta_sens: dict[str, Any] = {"method": sensitivity}
    if sensitivity == "fisher" and "feature_scale" not in fit_kwargs:
        fisher = measure_sensitivity(model, tokenizer, texts, windows=sensitivity_windows, sinks=sinks,
                                     progress=progress, labels=sensitivity_labels, sampling=sampling)
        fit_kwargs["feature_scale"] = sensitivity_scales(fisher, sensitivity_resolution, sensitivity_floor,
                                                         layout.head_dim)
        meta_sens.update(windows=sensitivity_windows, context=SENSITIVITY_CONTEXT,
                         continuation=SENSITIVITY_CONTINUATION, resolution=sensitivity_resolution,
                         labels=sensitivity_labels, normalize="kind", floor=sensitivity_floor,
                         seconds=round(time.perf_counter() - t0, 3))
    rows = collect_rows(model, tokenizer, texts, tokens, window, sinks, progress, sampling)
    say = (lambda msg: log.info("calibration: %s", msg)) if progress else None
    meta = dict(corpus or {})
    meta.update({"tokens": tokens, "window": window, "sinks_excluded": sinks, "sampling": sampling,
                 "sensitivity": meta_sens})
    cal = fit_calibration(layout, _timed(rows, meta), ratios=ratios, grouping=grouping, rope=rope.to_dict(),
                          model_id=model_id or str(getattr(model.config, "_name_or_path", "")), corpus=meta,
                          progress=say, **fit_kwargs)
    cal.stats["seconds"]["total"] = round(time.perf_counter() - t0, 3)
    cal.stats["seconds"]["collect"] = meta.pop("_collect_s", None)
    return Calibration(cal.layout, cal.grouping, cal.pcas, cal.plans, cal.rope, cal.model_id, cal.corpus, cal.stats)


def _timed(rows: Iterator[tuple[torch.Tensor, torch.Tensor]], meta: dict[str, Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    spent = 0.0
    while True:
        t0 = time.perf_counter()
        try:
            pair = next(rows)
        except StopIteration:
            break
        spent += time.perf_counter() - t0
        yield pair
    meta["_collect_s"] = round(spent, 3)


def check_model(calibration: Calibration, model: Any) -> None:
    """Refuse a calibration made for another model (layout or RoPE differ)."""
    layout, rope = describe_model(model)
    calibration.check_model(layout, rope, model=f"model {getattr(getattr(model, 'config', None), 'name_or_path', '') or 'given'}")


def default_calibration(tokens: int = DEFAULT_TOKENS, progress: bool = True,
                        sensitivity: str = DEFAULT_SENSITIVITY) -> Path:
    """The embedded default's calibration (SmolLM2 on pre-2000 State of the Union speeches), built on first
    use and cached; returns its path. ``sensitivity="none"``: the unweighted one (the eval's ablation)."""
    from .. import assets

    if sensitivity not in SENSITIVITIES:
        raise CalibrationError(f"unknown sensitivity {sensitivity!r}; use one of {', '.join(SENSITIVITIES)}")
    recipe = DEFAULT_RECIPE if sensitivity == "fisher" else UNWEIGHTED_RECIPE
    path = assets.cache_dir() / "calibrations" / f"smollm2-sotu-pre2000-{tokens}-{recipe}.safetensors"
    if path.is_file():
        return path
    with assets.file_lock(path.with_suffix(".lock")):
        if path.is_file():
            return path
        model, tok = assets.load_model("default")
        log.info("building the default calibration (%d tokens); this happens once", tokens)
        cal = calibrate_model(model, tok, assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR), tokens=tokens,
                              model_id=assets.DEFAULT_MODEL, corpus={"name": "sotu-pre2000"}, progress=progress,
                              sensitivity=sensitivity)
        cal.save(path)
    return path


def _bar(total: int, desc: str, enabled: bool) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        enabled = False
    if not enabled:
        class _Null:
            def update(self, _n: int) -> None: ...
            def close(self) -> None: ...
        return _Null()
    return tqdm(total=total, desc=desc, unit="tok", smoothing=0.1)
