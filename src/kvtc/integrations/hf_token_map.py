"""The token map of a Hugging Face causal LM (:mod:`kvtc.calibration.token_map`): fitted on windows of the
calibration corpus before the calibration rows are collected, kept where its held-out gain says it pays."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from ..calibration import token_map as tm
from ..calibration.recipe import Recipe
from ..calibration.token_map import TokenMap
from ..errors import CalibrationError
from ..progress import bar as progress_bar
from .hf import describe_model, extract_slice

log = logging.getLogger(__name__)


def token_map_windows(recipe: Recipe) -> int:
    """How many windows of the corpus the token map of ``recipe`` is fitted on (the last of them held out):
    :data:`~kvtc.calibration.token_map.FIT_SHARE` of its tokens, at most
    :data:`~kvtc.calibration.token_map.MAX_FIT_TOKENS`, at least two windows."""
    per = recipe.window - recipe.sinks
    return max(2, min(-(-int(recipe.tokens * tm.FIT_SHARE) // per), -(-tm.MAX_FIT_TOKENS // per)))


def fit_token_map(
    model: Any,
    windows: Iterable[torch.Tensor],
    count: int,
    recipe: Recipe,
    feature_scale: dict[str, torch.Tensor] | None = None,
    progress: bool = True,
) -> tuple[TokenMap | None, dict[str, Any]]:
    """The token map ``recipe.token_map`` asks for and notes on it: fitted on ``count`` token-id ``windows`` (not the
    calibration rows'), the last :data:`~kvtc.calibration.token_map.HOLDOUT_SHARE` of them held out to measure its
    gain; ``"auto"`` keeps it only when the gain reaches :data:`~kvtc.calibration.token_map.MIN_GAIN`, ``"on"``
    fits it on every window and measures nothing."""
    from transformers import DynamicCache

    t0 = time.perf_counter()
    layout, _ = describe_model(model)
    emb = model.get_input_embeddings().weight.detach()
    measure = recipe.token_map != "on"
    held = max(1, round(count * tm.HOLDOUT_SHARE)) if measure else 0
    fit = tm.TokenMapFit(emb.float(), layout.num_features)
    device = next(model.parameters()).device
    bar = progress_bar(count, "token map windows", progress, unit="window")
    done = 0
    try:
        for ids in windows:
            with torch.inference_mode():
                cache = DynamicCache()  # config-less: every layer keeps every token
                model.get_decoder()(input_ids=ids[None].to(device), past_key_values=cache, use_cache=True)
            kv = extract_slice(cache, model, every_token=True)
            rows = {
                kind: t[0, recipe.sinks :].reshape(-1, layout.num_features)
                for kind, t in (("keys", kv.keys), ("values", kv.values))
            }
            fit.add(ids, rows, recipe.sinks, held_out=done >= count - held)
            done += 1
            bar.update(1)
    finally:
        bar.close()
    if done < 2:
        raise CalibrationError("the corpus holds too few windows to fit the token map; add text or use token_map='off'")
    gain = fit.gain(feature_scale) if measure else {}
    mean_gain = (gain["keys"] + gain["values"]) / 2 if measure else 1.0
    keep = not measure or mean_gain >= tm.MIN_GAIN
    notes: dict[str, Any] = {
        "method": recipe.token_map,
        "kept": keep,
        "gain": {k: round(v, 4) for k, v in gain.items()},
        "min_gain": tm.MIN_GAIN,
        "windows": done,
        "held_out": held,
    }
    if measure:
        log.info(
            "calibration: the token map saves %.0f%% of the distortion on held-out windows (%s)",
            100 * mean_gain,
            "kept" if keep else "left out",
        )
    result = fit.result(emb.shape[0], gain) if keep else None
    notes["seconds"] = round(time.perf_counter() - t0, 3)
    return result, notes


__all__ = ["fit_token_map", "token_map_windows"]
