"""Where calibration windows come from: spread across the corpus.

The pre-2000 State of the Union corpus is sorted by year, so a calibration that took its first windows would see
only the 1790s; these tests pin down that the sampling reaches across the corpus, is deterministic, counts rows
exactly, and refuses what it cannot do with a typed error.
"""

from __future__ import annotations

import pytest
import torch

from kvtc import assets
from kvtc.errors import CalibrationError
from kvtc.integrations.hf_calibrate import collect_rows, corpus_windows


@pytest.fixture(scope="module")
def dated_docs(sotu_calib_texts):
    years = [year for year, _ in assets.sotu_files(before=assets.SOTU_SPLIT_YEAR)]
    assert len(years) == len(sotu_calib_texts)
    return years, sotu_calib_texts


def _source_years(tok, windows: list[torch.Tensor], years: list[int], texts: list[str]) -> list[int]:
    """The year of the document each window was cut from (found by a decoded piece of its middle)."""
    found = []
    for w in windows:
        piece = tok.decode(w[len(w) // 2 : len(w) // 2 + 12]).strip()
        hits = [y for y, t in zip(years, texts) if piece in t]
        assert hits, f"window text {piece!r} is in no document"
        found.append(hits[0])
    return found


def test_spread_sampling_reaches_across_a_dated_corpus(smollm2, dated_docs) -> None:
    _, tok = smollm2
    years, texts = dated_docs
    spread = list(corpus_windows(tok, texts, 256, 12))
    assert len(spread) == 12 and all(w.shape == (256,) for w in spread)
    spread_years = _source_years(tok, spread, years, texts)
    # from ~12 documents across two centuries (the first windows would all come from the 1790s)
    assert len(set(spread_years)) >= 10
    assert min(spread_years) < 1900 < max(spread_years)


def test_spread_sampling_is_deterministic_per_seed(smollm2, dated_docs) -> None:
    _, tok = smollm2
    _, texts = dated_docs
    texts = texts[-20:]  # a short corpus: fast to tokenize
    a = torch.stack(list(corpus_windows(tok, texts, 128, 6, seed=0)))
    b = torch.stack(list(corpus_windows(tok, texts, 128, 6, seed=0)))
    c = torch.stack(list(corpus_windows(tok, texts, 128, 6, seed=1)))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_collect_rows_counts_rows_exactly_and_skips_the_sinks(smollm2, dated_docs) -> None:
    model, tok = smollm2
    _, texts = dated_docs
    texts = texts[-10:]
    rows = list(collect_rows(model, tok, texts, 300, window=128, sinks=4, progress=False))
    assert [k.shape[0] for k, _ in rows] == [124, 124, 52]
    assert all(k.shape == v.shape and k.dtype == torch.float32 for k, v in rows)
    # the same windows through the model: rows are positions 4.. of each window, not position 0
    ids = next(corpus_windows(tok, texts, 128, 3))
    from transformers import DynamicCache

    from kvtc.integrations.hf import extract_slice

    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids[None], past_key_values=cache, use_cache=True)
    kv = extract_slice(cache, model)
    want = kv.keys[0, 4:].reshape(124, -1).float()
    assert torch.allclose(rows[0][0], want, atol=1e-5, rtol=1e-5)


def test_bfloat16_forward_reads_rows_close_to_float32_and_leaves_the_model_as_it_was(smollm2, dated_docs) -> None:
    """The default forward pass runs under bfloat16 autocast: its rows are the float32 pass's within about 1% (the
    calibration's rows, not what the codec codes), and the model's own weights are untouched."""
    from kvtc.integrations.hf_calibrate import window_rows

    model, tok = smollm2
    texts = dated_docs[1][-10:]
    before = {n: p.clone() for n, p in model.named_parameters()}
    exact = list(window_rows(model, tok, texts, 248, window=128, progress=False, forward="model"))
    fast = list(window_rows(model, tok, texts, 248, window=128, progress=False, forward="bfloat16"))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(exact, fast))  # the same windows
    for (_, k, v), (_, kb, vb) in zip(exact, fast):
        assert kb.dtype == torch.float32 and kb.shape == k.shape
        for x, y in ((k, kb), (v, vb)):
            rel = float((x - y).norm() / x.norm())
            assert 0 < rel < 0.02, rel
    assert all(torch.equal(p, before[n]) and p.dtype == torch.float32 for n, p in model.named_parameters())
    with pytest.raises(CalibrationError, match="forward"):
        list(window_rows(model, tok, texts, 124, window=128, progress=False, forward="fp4"))


def test_sampling_refuses_too_little_text(smollm2, dated_docs) -> None:
    model, tok = smollm2
    _, texts = dated_docs
    short = [texts[0][:2000]]
    with pytest.raises(CalibrationError, match="fewer than 40 windows"):
        list(corpus_windows(tok, short, 256, 40))
    with pytest.raises(CalibrationError, match="calibration tokens|fewer than"):
        list(collect_rows(model, tok, short, 10_000, window=256, progress=False))


def test_spread_windows_hold_one_document_at_a_time(smollm2, dated_docs) -> None:
    """A corpus of any size is sampled in bounded memory: every document is tokenized once to measure it, and a
    second time only if a window is cut from it; the windows equal :func:`assets.token_windows`'s."""
    _, tok = smollm2
    _, texts = dated_docs
    texts = texts[-40:]
    calls: list[int] = []
    index = {t: i for i, t in enumerate(texts)}

    class Counting:
        eos_token_id = tok.eos_token_id

        def __call__(self, text, **kw):
            if text:  # an empty text is the probe for what the tokenizer adds around a text (leading_ids)
                calls.append(index[text])
            return tok(text, **kw)

    windows = list(assets.iter_token_windows(Counting(), texts, 512, 6, seed=0))
    assert calls[: len(texts)] == list(range(len(texts)))  # the measuring pass
    second = calls[len(texts) :]
    assert len(second) == len(set(second)) <= 6  # only the documents windows come from, once each
    assert torch.equal(torch.stack(windows), assets.token_windows(tok, texts, 512, 6, seed=0))
