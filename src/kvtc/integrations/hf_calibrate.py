"""Calibrate any Hugging Face causal LM: run it over a corpus, collect pre-RoPE keys and values, fit.

Sampling follows the paper: whole documents are cut into windows (default 1,024 tokens), the model is run
over each window, the first ``sinks`` positions of every window are excluded (attention sinks are never
compressed, so they must not shape the basis), and every other position becomes one calibration row.
Rows stream into the PCA accumulators window by window, so memory is ``O(p²)`` whatever the token count.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ..calibration import Calibration, fit_calibration
from ..calibration.fit import DEFAULT_RATIOS
from ..codec import DEFAULT_SINKS
from ..errors import CalibrationError
from ..layout import PCAGrouping
from .hf import describe_model, extract_slice

log = logging.getLogger(__name__)

#: tokens per calibration window (the paper used documents of 1K–32K tokens)
DEFAULT_WINDOW_TOKENS = 1024
#: calibration size of the embedded default (the paper used ~160K tokens for 8B models)
DEFAULT_TOKENS = 100_000
#: names the fitting recipe of the cached default calibration (ratio grid, K/V split); a new recipe is a new file
DEFAULT_RECIPE = "r2"


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


def collect_rows(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    tokens: int,
    window: int = DEFAULT_WINDOW_TOKENS,
    sinks: int = DEFAULT_SINKS,
    progress: bool = True,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(key_rows, value_rows)`` float32 ``[window - sinks, p]`` per window until ``tokens`` rows."""
    from transformers import DynamicCache

    if window <= sinks:
        raise CalibrationError(f"calibration window ({window}) must be longer than the sinks ({sinks})")
    layout, _ = describe_model(model)
    device = next(model.parameters()).device
    bar = _bar(tokens, "calibration tokens", progress)
    done = 0
    try:
        for ids in token_windows(tokenizer, texts, window):
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
    **fit_kwargs: Any,
) -> Calibration:
    """Calibration of ``model`` on ``texts``: pre-RoPE PCA bases and a DP bit plan per ratio.

    ``tokens`` calibration rows are taken from windows of ``window`` tokens, the first ``sinks`` positions of
    each excluded. The model's RoPE spec is stored in the calibration and checked whenever it is used.
    """
    layout, rope = describe_model(model)
    t0 = time.perf_counter()
    rows = collect_rows(model, tokenizer, texts, tokens, window, sinks, progress)
    say = (lambda msg: log.info("calibration: %s", msg)) if progress else None
    meta = dict(corpus or {})
    meta.update({"tokens": tokens, "window": window, "sinks_excluded": sinks})
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
    from ..errors import CalibrationMismatch
    from ..rope import RopeSpec

    layout, rope = describe_model(model)
    calibration.check_layout(layout)
    if calibration.rope is None:
        raise CalibrationMismatch("the calibration records no RoPE spec; recalibrate with `kvtc calibrate`")
    theirs = RopeSpec.from_dict(calibration.rope)
    if theirs.fingerprint() != rope.fingerprint():
        raise CalibrationMismatch(
            f"the model's RoPE ({rope.fingerprint()}) differs from the calibration's ({theirs.fingerprint()}): "
            "it was made for another model or configuration; recalibrate with `kvtc calibrate --model ...`"
        )


def default_calibration(tokens: int = DEFAULT_TOKENS, progress: bool = True) -> Path:
    """The embedded default's calibration (SmolLM2 on pre-2000 State of the Union speeches), built on first
    use and cached; returns its path."""
    from .. import assets

    path = assets.cache_dir() / "calibrations" / f"smollm2-sotu-pre2000-{tokens}-{DEFAULT_RECIPE}.safetensors"
    if path.is_file():
        return path
    with assets.file_lock(path.with_suffix(".lock")):
        if path.is_file():
            return path
        model, tok = assets.load_model("default")
        log.info("building the default calibration (%d tokens); this happens once", tokens)
        cal = calibrate_model(model, tok, assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR), tokens=tokens,
                              model_id=assets.DEFAULT_MODEL, corpus={"name": "sotu-pre2000"}, progress=progress)
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
