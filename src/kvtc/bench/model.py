"""What ``kvtc bench`` measures on: the device, the model (real, or random weights of a config), its calibration
and the token ids of each context.

A random-weight model has the shape of a real one (speed does not depend on the weights) and is calibrated here on
its own KV of random token ids, for exactly the ratios asked: its timings and sizes are meaningful, its quality is
not. torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, KVTCError

#: random-weight model shapes by name (``--random-weights NAME``); any other value is a config.json file or a
#: directory holding one
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "tiny": dict(  # a few milliseconds per step on a CPU: the tests' model
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}

#: sinks left out of a random-weight calibration's rows (their KV is unlike the rest: the codec stores them raw)
CALIBRATION_SINKS = 4


def resolve_device(name: str) -> Any:
    """The ``torch.device`` of ``--device``: ``cpu``, ``cuda`` or ``cuda:N``; a :class:`KVTCError` when CUDA is
    asked for and absent."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {name[:40]!r} is not a device; give cpu or cuda (cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name[:40]!r}: kvtc bench runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise KVTCError(
                f"--device {name}: no CUDA GPU is visible here (torch {torch.__version__}, "
                f"cuda {torch.version.cuda or 'not built in'}); run on a GPU machine or use --device cpu"
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise KVTCError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


def sync(device: Any) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def config_path(spec: str) -> Path | None:
    """The config.json ``--random-weights`` names (None for a preset); a :class:`ConfigError` when it names neither
    (checked before anything is loaded)."""
    if spec in PRESETS:
        return None
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"--random-weights {spec[:80]!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file or "
            "directory"
        )
    return path


def random_config(spec: str) -> Any:
    """The transformers config of ``--random-weights``: a :data:`PRESETS` name, a config.json, or a directory
    holding one."""
    from transformers import AutoConfig

    path = config_path(spec)
    if path is None:
        fields = dict(PRESETS[spec])
    else:
        try:
            fields = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"--random-weights {path}: not a JSON config ({e})") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
            raise ConfigError(f"--random-weights {path}: a config.json names its model_type; this one does not")
    kind = fields.pop("model_type")
    try:
        return AutoConfig.for_model(kind, **fields)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"--random-weights {spec[:80]}: transformers cannot build a {kind!r} config ({e})") from None


def random_model(spec: str, device: Any, dtype: Any) -> Any:
    """A seeded random-weight causal LM of ``spec``'s shape on ``device``, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    config = random_config(spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@dataclass
class Loaded:
    """The model, its tokenizer (None for random weights) and calibration, and how they were named."""

    model: Any
    tokenizer: Any
    calibration: Any
    name: str
    calibration_name: str
    random: bool


def load(
    model: str,
    calibration: str | None,
    device: Any,
    random_weights: str | None,
    ratios: tuple[float, ...],
    calibration_tokens: int,
    progress: bool,
) -> Loaded:
    """The model (real: ``assets.load_model``; or random weights) and its calibration: a file, ``"default"`` (the
    embedded model's own: :func:`kvtc.integrations.hf_calibrate.load_calibration`), or for random weights without
    one, a calibration fitted here on the model's own KV."""
    import torch

    from .. import assets
    from ..integrations.hf import check_model
    from ..integrations.hf_calibrate import default_calibration_path, load_calibration

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if random_weights is not None:
        lm, tok, name = random_model(random_weights, device, dtype), None, f"random weights: {random_weights}"
        if calibration in (None, "default"):
            cal = fit_random_calibration(lm, ratios, calibration_tokens, device, progress)
            cal_name = f"fitted here on {cal.stats.get('samples')} rows of the model's own KV (random token ids)"
        else:
            cal, cal_name = load_calibration(calibration), Path(calibration).name
    else:
        lm, tok = assets.load_model(model, dtype=dtype, device=device)
        embedded = assets.embedded_model(model)
        name = embedded.name if embedded is not None else model
        source = calibration or "default"
        cal = load_calibration(source, model=model, progress=progress)
        if source == "default":
            cal_name = default_calibration_path(model=embedded.key).name if embedded is not None else source
        else:
            cal_name = Path(source).name
    check_model(cal, lm)
    return Loaded(lm, tok, cal, name, cal_name, random_weights is not None)


def max_context(model: Any) -> int | None:
    """The most tokens the model's positions cover (``max_position_embeddings``), or None when it says nothing."""
    n = getattr(model.config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def context_ids(loaded: Loaded, tokens: int, device: Any, seed: int = 0) -> Any:
    """``[1, tokens]`` token ids: a held-out text window (State of the Union speeches from 2000 on, the
    calibration's unseen split) for a real model, random ids for random weights."""
    import torch

    from .. import assets

    if loaded.tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, loaded.model.config.vocab_size, (1, tokens), generator=g)
    else:
        texts = assets.sotu_texts(since=assets.SOTU_SPLIT_YEAR)
        ids = assets.token_windows(loaded.tokenizer, texts, tokens, 1, seed=seed)
    return ids.to(device)


def fit_random_calibration(model: Any, ratios: tuple[float, ...], samples: int, device: Any, progress: bool) -> Any:
    """A calibration for ``ratios`` fitted on ``samples`` rows of the model's own pre-RoPE KV, prefilled from random
    token ids (exact PCA for narrow models, randomized above :data:`~kvtc.calibration.pca.EXACT_MAX_FEATURES`)."""
    import torch
    from transformers import DynamicCache

    from ..calibration import Recipe, fit_calibration
    from ..integrations.hf import describe_model, extract_slice
    from ..progress import bar

    layout, spec = describe_model(model)
    p = layout.num_features
    seq = min(2048, max_context(model) or 2048)
    g = torch.Generator().manual_seed(1)
    krows: list[Any] = []
    vrows: list[Any] = []
    n = 0
    with bar(samples, "bench: calibration rows", progress, unit="row") as tick, torch.inference_mode():
        while n < samples:
            ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=g).to(device)
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            kv = extract_slice(cache, model)
            take = min(samples - n, seq - CALIBRATION_SINKS)
            krows.append(kv.keys[0, CALIBRATION_SINKS : CALIBRATION_SINKS + take].reshape(take, p).clone())
            vrows.append(kv.values[0, CALIBRATION_SINKS : CALIBRATION_SINKS + take].reshape(take, p).clone())
            n += take
            tick(take)
            del cache, kv
    keys, values = torch.cat(krows), torch.cat(vrows)
    del krows, vrows
    chunk = 8192

    def rows() -> Any:
        return ((keys[i : i + chunk], values[i : i + chunk]) for i in range(0, keys.shape[0], chunk))

    recipe = Recipe(ratios=tuple(ratios), rank_cap=min(Recipe().rank_cap, samples))
    with bar(1, "bench: fitting the calibration", progress) as tick:
        cal = fit_calibration(layout, rows, recipe, device=device, rope=spec.to_dict(), model_id="random-weights")
        tick(1)
    return cal
