"""One ``kvtc eval`` run: load the model, texts and calibrations, build the methods, run the protocols.

:func:`run` returns a JSON-ready dictionary (configuration, machine facts, per-protocol results per method,
skipped peers and why, timings, acceptance checks); :mod:`kvtc.eval.report` turns it into a table and a plot.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import __version__, assets
from ..calibration import Calibration, Recipe, fit_calibration
from ..calibration.load import DEFAULT_CALIBRATION
from ..calibration.recipe import RECIPES, UNWEIGHTED_RECIPE
from ..layout import PCAGrouping
from ..progress import StageTimer, bar
from ..textsafe import message
from .acceptance import acceptance
from .config import (  # noqa: F401  (re-exported: the run's defaults live with its configuration)
    DEFAULT_ABLATION_TOKENS,
    DEFAULT_CONTEXT,
    DEFAULT_CONTINUATION,
    DEFAULT_CONVERSATION_TOKENS,
    DEFAULT_HAYSTACK,
    DEFAULT_NEEDLE_LENGTHS,
    DEFAULT_NEEDLE_PROMPTS,
    DEFAULT_RATIOS,
    DEFAULT_RETRIEVAL_DEPTHS,
    DEFAULT_RETRIEVAL_LENGTHS,
    DEFAULT_RETRIEVAL_PROMPTS,
    DEFAULT_TEXTS,
    DEFAULT_WINDOWS,
    PEER_BACKENDS,
    EvalConfig,
)
from .greedy import greedy_calibration, paper_types_calibration
from .methods import FP8, KIVI, Eviction, Method, Peer, peer_available
from .methods import KVTC as _KVTC
from .protocols import (
    HAYSTACKS,
    NEEDLE_KINDS,
    PASSKEY_FILLER,
    Tally,
    conversation,
    needle_prompts,
    passkey_prompts,
    retrieval,
    storage_roundtrip,
)


def _say(cfg: EvalConfig, msg: str) -> None:
    if cfg.progress:
        print(f"kvtc eval: {message(msg)}", flush=True)


def _texts(names: Sequence[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        out.extend(assets.corpus(name))
    return out


def _load_calibration(cfg: EvalConfig) -> tuple[Calibration, str]:
    from ..integrations.hf_calibrate import default_calibration_path, load_calibration

    embedded = assets.embedded_model(cfg.model)
    if cfg.calibration:
        name = Path(cfg.calibration).name
    else:  # a model that is not embedded has no default calibration: load_calibration says so
        name = default_calibration_path(model=embedded.key).name if embedded else DEFAULT_CALIBRATION
    return load_calibration(cfg.calibration or DEFAULT_CALIBRATION, model=cfg.model, progress=cfg.progress), name


def _ablation_calibrations(
    cfg: EvalConfig, model: Any, tok: Any, cal: Calibration
) -> tuple[dict[str, Calibration], dict[str, Any]]:
    """Per-layer-PCA, greedy-allocator and paper's-types calibrations, fitted on the same freshly collected rows
    (cached)."""
    from ..integrations.hf import describe_model
    from ..integrations.hf_calibrate import collect_rows

    ratios = [r for r in cfg.ablation_ratios]
    tag = f"{cal.fingerprint[:12]}-{cfg.ablation_tokens}-{'-'.join(format(r, 'g') for r in ratios)}"
    root = assets.cache_dir() / "calibrations"
    paths = {
        "per-layer": root / f"eval-ablation-perlayer-{tag}.safetensors",
        "greedy": root / f"eval-ablation-greedy-{tag}.safetensors",
        "paper-types": root / f"eval-ablation-papertypes-{tag}.safetensors",
    }
    info: dict[str, Any] = {"tokens": cfg.ablation_tokens, "corpus": "sotu-pre2000", "cached": False}
    if all(p.is_file() for p in paths.values()):
        info["cached"] = True
        return {k: Calibration.load(p) for k, p in paths.items()}, info
    timer = StageTimer()
    layout, rope = describe_model(model)
    texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
    _say(cfg, f"collecting {cfg.ablation_tokens} calibration rows for the ablations")
    with timer("collect_s"):
        # the default calibration's token map (if any) applies to every ablation: each codes the same residuals
        rows = list(
            collect_rows(
                model, tok, texts, cfg.ablation_tokens, sinks=cfg.sinks, progress=cfg.progress, token_map=cal.token_map
            )
        )
    _say(cfg, "fitting the per-layer-PCA calibration")
    # the same sensitivity weighting as the global calibration: this ablation changes the grouping only
    scales = {k: cal.feature_scale(k) for k in ("keys", "values")} if cal.weighted else None
    with timer("per_layer_fit_s"):
        per_layer = fit_calibration(
            layout,
            rows,
            Recipe(ratios=ratios, grouping=PCAGrouping("layers", 1)),
            rope=rope.to_dict(),
            model_id=cal.model_id,
            feature_scale=scales,
            corpus={"name": "sotu-pre2000", "tokens": cfg.ablation_tokens},
        )
        if cal.token_map is not None:
            per_layer = dataclasses.replace(per_layer, token_map=cal.token_map)
    _say(cfg, "greedy bit plans on the default basis")
    with timer("greedy_fit_s"):
        greedy = greedy_calibration(cal, rows, ratios)
    _say(cfg, "bit plans with the paper's quantization types on the default basis")
    with timer("paper_types_fit_s"):
        paper = paper_types_calibration(cal, rows, ratios)
    info.update(timer.rounded(1))
    del rows
    out = {"per-layer": per_layer, "greedy": greedy, "paper-types": paper}
    for k, p in paths.items():
        out[k].save(p)
    return out, info


def _peers(cfg: EvalConfig) -> tuple[list[Method], dict[str, str]]:
    methods: list[Method] = []
    skipped: dict[str, str] = {}
    for backend in cfg.peers:
        why = peer_available(backend)
        if why is not None:
            skipped[backend] = why
            _say(cfg, f"skipping {backend}: {why}")
            continue
        for bits in (2, 4):
            methods.append(Peer(backend, bits))
    return methods, skipped


def _machine() -> dict[str, Any]:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kvtc": __version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        import os

        info["cores"] = len(os.sched_getaffinity(0))
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["load_average_start"] = os.getloadavg()[0]
    except (OSError, AttributeError):
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _rows(
    tallies: dict[str, Tally], methods: Sequence[Method], extra: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    by_label = {m.label: m for m in methods}
    rows = []
    for label, t in tallies.items():
        m = by_label.get(label)
        row = {"method": label, "curve": m.name if m else "exact", **t.summary()}
        if m is not None and hasattr(m, "ratio"):
            row["target"] = m.ratio
        row.update((extra or {}).get(label, {}))
        rows.append(row)
    return rows


def kvtc_ratios(requested: Sequence[float] | None, planned: Sequence[float]) -> list[float]:
    """The kvtc targets a run measures: ``requested`` (each must be planned), every planned ratio for an empty
    ``requested``, or for None :data:`DEFAULT_RATIOS` the calibration plans (all of them if it plans none of those)."""
    have = [float(r) for r in planned]
    if requested is None:
        return [float(r) for r in DEFAULT_RATIOS if float(r) in have] or have
    ratios = [float(r) for r in requested] or have
    missing = [r for r in ratios if r not in have]
    if missing:
        raise ValueError(f"the calibration has no plans for ratios {missing}; it has {have}")
    return ratios


def run(cfg: EvalConfig) -> dict[str, Any]:
    timer = StageTimer()
    torch.manual_seed(cfg.seed)
    out: dict[str, Any] = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
        "machine": _machine(),
        "skipped": {},
    }

    with timer("load"):
        model, tok = assets.load_model(cfg.model, dtype=torch.float32, device=cfg.device)
        cal, cal_name = _load_calibration(cfg)
    embedded = assets.embedded_model(cfg.model)
    out["model"] = embedded.name if embedded is not None else cfg.model
    out["calibration"] = {
        "name": cal_name,
        "fingerprint": cal.fingerprint,
        "corpus": cal.corpus,
        "ratios": cal.ratios,
        "samples": cal.stats.get("samples"),
    }
    ratios = kvtc_ratios(cfg.ratios, cal.ratios)
    # a calibration with a token map codes each token less a prediction from its ids and the model's embeddings
    KVTC = functools.partial(_KVTC, embeddings=model.get_input_embeddings().weight)  # noqa: N806

    kvtc = [KVTC(cal, r) for r in ratios]
    methods: list[Method] = list(kvtc)
    if cfg.baselines:
        methods += [FP8(), KIVI(2), KIVI(4)]
        peers, skipped = _peers(cfg)
        methods += peers
        out["skipped"].update(skipped)
        methods += [Eviction(r) for r in cfg.eviction_ratios]
    if cfg.quick:
        methods = [KVTC(cal, ratios[0]), KIVI(2)]
    if cfg.ablations:
        with timer("ablation_calibration"):
            abl, info = _ablation_calibrations(cfg, model, tok, cal)
        out["ablation_calibration"] = info
        methods += [
            KVTC(abl["per-layer"], r, name="kvtc-per-layer-pca", label=f"kvtc per-layer PCA {r:g}x")
            for r in cfg.ablation_ratios
        ]
        methods += [
            KVTC(abl["greedy"], r, name="kvtc-greedy", label=f"kvtc greedy allocator {r:g}x")
            for r in cfg.ablation_ratios
        ]
        if cal.extended_types:
            methods += [
                KVTC(
                    abl["paper-types"],
                    r,
                    name="kvtc-paper-types",
                    label=f"kvtc with the paper's quantization types {r:g}x",
                )
                for r in cfg.ablation_ratios
            ]
        if cfg.calibration is None and cal.weighted:
            # the default recipe without sensitivity weighting (the paper's plain squared error), same rows
            from ..integrations.hf_calibrate import default_calibration

            with timer("ablation_calibration"):
                plain = Calibration.load(
                    default_calibration(RECIPES[UNWEIGHTED_RECIPE], progress=cfg.progress, model=cfg.model)
                )
            out["ablation_calibration"]["unweighted"] = {"fingerprint": plain.fingerprint, "corpus": plain.corpus}
            methods += [
                KVTC(plain, r, name="kvtc-unweighted", label=f"kvtc without sensitivity weighting {r:g}x")
                for r in cfg.ablation_ratios
            ]

    texts = _texts(cfg.texts)
    out["texts"] = list(cfg.texts)

    # 1. storage round trip
    with timer("storage_roundtrip"):
        windows = assets.token_windows(tok, texts, cfg.context + cfg.continuation + 1, cfg.windows, seed=cfg.seed)
        windows = windows.to(cfg.device)
        _say(cfg, f"storage round trip: {cfg.windows} windows x {len(methods)} methods")
        with bar(cfg.windows * (len(methods) + 1), "storage round trip", cfg.progress) as progress:
            tallies = storage_roundtrip(model, windows, methods, cfg.context, cfg.sinks, cfg.window, progress)
    out["storage_roundtrip"] = _rows(tallies, methods)
    # entropy-coding ablation: the same symbols stored bit-packed only (same quality, the bytes before entropy)
    for r in list(out["storage_roundtrip"]):
        if r["curve"] == "kvtc" and "ratio_before_entropy" in r:
            out["storage_roundtrip"].append(
                {
                    **r,
                    "method": f"kvtc without entropy coding {r['target']:g}x",
                    "curve": "kvtc-no-entropy",
                    "ratio": r["ratio_before_entropy"],
                }
            )

    # 2. simulated conversation
    if cfg.conversation:
        with timer("conversation"):
            conv_methods: list[Method] = [KVTC(cal, r) for r in cfg.conversation_ratios if r in cal.ratios]
            conv_methods += [FP8(), KIVI(2), KIVI(4)] if cfg.baselines else []
            ids = assets.token_windows(tok, texts, cfg.conversation_tokens, 1, seed=cfg.seed + 1).to(cfg.device)
            _say(cfg, f"simulated conversation: {cfg.conversation_tokens} tokens x {len(conv_methods)} methods")
            with bar(len(conv_methods) + 1, "simulated conversation", cfg.progress) as progress:
                tallies = conversation(model, ids, conv_methods, cfg.sinks, cfg.window, progress=progress)
        out["conversation"] = _rows(tallies, conv_methods)

    # 3. retrieval
    if cfg.retrieval:
        with timer("retrieval"):
            ret_methods: list[Method] = [KVTC(cal, r) for r in cfg.retrieval_ratios if r in cal.ratios]
            if cfg.baselines:
                ret_methods += [KIVI(2)] + [Eviction(r) for r in cfg.retrieval_ratios]
            if cfg.retrieval_haystack not in HAYSTACKS:
                raise ValueError(f"unknown haystack {cfg.retrieval_haystack!r}; use one of {', '.join(HAYSTACKS)}")
            hay = (
                texts
                if cfg.retrieval_haystack == "text"
                else [PASSKEY_FILLER * (2 + 8 * max(cfg.retrieval_lengths) // 20)]
            )
            prompts = []
            # every length gets about the same number of tokens: shorter lengths get more prompts
            weights = [1.0 / n for n in cfg.retrieval_lengths]
            counts = [max(1, round(cfg.retrieval_prompts * w / sum(weights))) for w in weights]
            counts[0] += max(0, cfg.retrieval_prompts - sum(counts))
            for i, (length, count) in enumerate(zip(cfg.retrieval_lengths, counts)):
                depths = [cfg.retrieval_depths[j % len(cfg.retrieval_depths)] for j in range(count)]
                for j, d in enumerate(depths):
                    prompts += passkey_prompts(tok, hay, [length], [d], 1, seed=cfg.seed + 1000 * i + j)
            _say(cfg, f"retrieval: {len(prompts)} pass-key prompts x {len(ret_methods) + 1} caches")
            prompts = [dataclasses.replace(p, ids=p.ids.to(cfg.device)) for p in prompts]
            with bar(len(prompts) * (len(ret_methods) + 1), "retrieval", cfg.progress) as progress:
                tallies, records = retrieval(model, tok, prompts, ret_methods, cfg.sinks, cfg.window, progress=progress)
        out["retrieval"] = _rows(tallies, ret_methods)
        out["retrieval_prompts"] = records

    # 4. RULER-style needles
    if cfg.needles:
        with timer("needles"):
            out["needles"] = _needles(cfg, model, tok, cal, KVTC, texts)

    timer.add("total", timer.elapsed())
    out["timings_s"] = timer.rounded(1)
    out["machine"]["load_average_end"] = _loadavg()
    out["acceptance"] = acceptance(out)
    return out


def _needles(cfg: EvalConfig, model: Any, tok: Any, cal: Calibration, kvtc: Any, texts: list[str]) -> dict[str, Any]:
    """Single and multi-key needle prompts hidden in the evaluation text, at each length the model's context
    holds: one row per (kind, length, cache) and one record per prompt."""
    limit = getattr(model.config, "max_position_embeddings", None) or max(cfg.needle_lengths)
    lengths = [n for n in cfg.needle_lengths if n <= limit]
    out: dict[str, Any] = {"lengths": lengths, "left_out": [n for n in cfg.needle_lengths if n > limit], "rows": []}
    methods: list[Method] = [kvtc(cal, r) for r in cfg.needle_ratios if r in cal.ratios]
    if cfg.baselines:
        methods.append(KIVI(2))
    hay = texts  # RULER's haystack is prose (essays): here the evaluation text
    groups = [(kind, n) for kind in NEEDLE_KINDS for n in lengths]
    total = len(groups) * cfg.needle_prompts * (len(methods) + 1)
    _say(cfg, f"needles: {len(groups) * cfg.needle_prompts} prompts x {len(methods) + 1} caches")
    records: list[dict[str, Any]] = []
    with bar(total, "needles", cfg.progress) as progress:
        for g, (kind, n) in enumerate(groups):
            prompts = needle_prompts(tok, hay, n, kind, cfg.needle_prompts, seed=cfg.seed + 7919 * (g + 1))
            prompts = [dataclasses.replace(p, ids=p.ids.to(cfg.device)) for p in prompts]
            tallies, recs = retrieval(
                model, tok, prompts, methods, cfg.sinks, cfg.window, answer_tokens=12, progress=progress
            )
            for row in _rows(tallies, methods):
                out["rows"].append({"kind": kind, "length": n, **row})
            records += recs
    out["prompts"] = records
    return out


def _loadavg() -> float | None:
    try:
        import os

        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


__all__ = ["EvalConfig", "acceptance", "run"]
