"""The token map of a Hugging Face causal LM (:mod:`kvtc.calibration.token_map`): fitted on the first windows of the
calibration's own forward pass (their rows wait for it), kept where its held-out gain says it pays."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..calibration import token_map as tm
from ..calibration.recipe import Recipe
from ..calibration.token_map import TokenMap
from ..errors import CalibrationError
from .hf import describe_model

log = logging.getLogger(__name__)


def token_map_windows(recipe: Recipe) -> int:
    """How many of the calibration's windows (the first ones) the token map of ``recipe`` is fitted on: all of them
    up to :data:`~kvtc.calibration.token_map.MAX_FIT_TOKENS` tokens, at least two."""
    per = recipe.window - recipe.sinks
    return max(2, min(-(-recipe.tokens // per), -(-tm.MAX_FIT_TOKENS // per)))


def fit_token_map(
    model: Any,
    windows: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    recipe: Recipe,
    feature_scale: dict[str, torch.Tensor] | None = None,
) -> tuple[TokenMap | None, dict[str, Any], tuple[TokenMap, TokenMap] | None]:
    """The token map ``recipe.token_map`` asks for, notes on it, and the two maps that residualise ``windows``
    themselves: fitted on ``windows``, ``(ids [T], key_rows, value_rows)`` each, the rows ``[T - recipe.sinks, p]``
    (the calibration's own, read in its one forward pass).

    The windows are cross-fitted: even and odd windows form two parts, a map is solved on each, and window ``i``'s
    rows are predicted by the map of the part it is not in (``halves[1 - i % 2]``), so the PCA and the bit plans see
    residuals as the codec will on text the map never saw (in-sample residuals would be smaller, and plans sized on
    them would store more than their targets). The map returned is solved on every window. It is kept only where
    the map of the even windows saves at least :data:`~kvtc.calibration.token_map.MIN_GAIN` of the distortion on the
    odd ones."""
    t0 = time.perf_counter()
    count = len(windows)
    if count < 2:
        raise CalibrationError("the corpus holds too few windows to fit the token map; add text or use token_map='off'")
    layout, _ = describe_model(model)
    emb = model.get_input_embeddings().weight.detach()
    fit = tm.TokenMapFit(emb.float(), layout.num_features, block=layout.num_features // len(layout.layers))
    for i, (ids, k, v) in enumerate(windows):
        # the last window may hold fewer rows than positions: its ids up to the last row's token
        fit.add(ids[: recipe.sinks + k.shape[0]], {"keys": k, "values": v}, recipe.sinks, held_out=bool(i % 2))
    gain = fit.gain(feature_scale)
    mean_gain = (gain["keys"] + gain["values"]) / 2
    keep = mean_gain >= tm.MIN_GAIN
    notes: dict[str, Any] = {
        "method": recipe.token_map,
        "kept": keep,
        "gain": {k: round(v, 4) for k, v in gain.items()},
        "min_gain": tm.MIN_GAIN,
        "windows": count,
        "held_out": count // 2,
    }
    log.info(
        "calibration: the token map saves %.0f%% of the distortion on held-out windows (%s)",
        100 * mean_gain,
        "kept" if keep else "left out",
    )
    result = halves = None
    if keep:
        result = fit.result(emb.shape[0], gain)
        halves = (fit.result(emb.shape[0], part=0), fit.result(emb.shape[0], part=1))
    notes["seconds"] = round(time.perf_counter() - t0, 3)
    return result, notes, halves


__all__ = ["fit_token_map", "token_map_windows"]
