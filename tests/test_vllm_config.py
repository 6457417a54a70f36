"""Startup checks of the vLLM connector's configuration (no engine needed).

Each misconfiguration runs through the same steps the connector takes when an engine starts
(:func:`_startup`: parse ``kv_connector_extra_config``, load and check the calibration against the model's config,
check the chunk size against the block size, open the store) and must be refused there with a
:class:`ConfigError` whose message names the key, the value and the fix. The calibration is a tiny one fitted on
synthetic rows for a tiny Llama config (seconds); the served model is given by its transformers config.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from transformers import LlamaConfig

import tiny_models
from kvtc.calibration import Recipe
from kvtc.calibration.fit import fit_calibration
from kvtc.errors import ConfigError, KVTCError
from kvtc.integrations.hf import describe_model
from kvtc.integrations.vllm.codecs import Codecs
from kvtc.integrations.vllm.config import ConnectorConfig, ConnectorSetup, open_connector_store
from synthetic import LowRankSource

BLOCK = 16
RATIOS = (4, 8)


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    """A calibration of :func:`tiny_models.llama` with plans for 4x and 8x."""
    layout, rope = describe_model(tiny_models.llama())
    src = LowRankSource(layout.num_features, rank=8, seed=0)
    cal = fit_calibration(
        layout,
        [(src.rows(512), src.rows(512))],
        Recipe(ratios=RATIOS, dp_rows=256),
        rope=rope.to_dict(),
        model_id="tiny-llama",
    )
    return cal.save(tmp_path_factory.mktemp("cal") / "tiny-llama.kvtc-calib")


def _startup(extra, hf_config=None, block_size: int = BLOCK, model: str = "tiny-llama-served") -> ConnectorSetup:
    """What the connector does at engine start, with the engine's facts given directly."""
    config = ConnectorConfig.from_extra(extra)
    codecs = Codecs.for_model(
        config, hf_config if hf_config is not None else tiny_models.llama(), model=f"the served model {model!r}"
    )
    setup = ConnectorSetup(
        config,
        model=model,
        model_dtype="torch.bfloat16",
        block_size=block_size,
        tp_size=1,
        total_kv_heads=2,
        head_dim=16,
        calibration_hash=codecs.calibration_hash,
    )
    open_connector_store(config, setup.namespace(0)).close()
    return setup


def _refused(extra, *needles: str, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        _startup(extra, **kw)
    msg = str(info.value)
    assert isinstance(info.value, KVTCError) and isinstance(info.value, ValueError)
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


@pytest.fixture
def store(tmp_path) -> str:
    return f"file://{tmp_path}/store"


def test_a_good_configuration_starts(calibration, store, tmp_path):
    setup = _startup({"calibration": str(calibration), "ratio": "8", "chunk_tokens": "64", "sinks": 4, "store": store})
    assert setup.config.ratio == 8.0 and setup.config.chunk_tokens == 64  # strings from a CLI are converted
    assert (tmp_path / "store").is_dir()  # the store was opened at startup
    assert _startup({"codec": "identity", "store": store}).calibration_hash == "none"


def test_store_namespace_is_unchanged():
    """Entries written by earlier releases must still be found: the namespace formula is frozen."""

    def ns(codec: str, calibration_hash: str) -> str:
        config = ConnectorConfig(codec=codec, calibration="x" if codec == "kvtc" else None, ratio=16, sinks=4)
        setup = ConnectorSetup(
            config,
            model="/models/SmolLM2-135M-Instruct",
            model_dtype="torch.bfloat16",
            block_size=16,
            tp_size=2,
            total_kv_heads=3,
            head_dim=64,
            calibration_hash=calibration_hash,
        )
        return setup.namespace(1)

    assert ns("identity", "none") == "vllm:SmolLM2-135M-Instruct:d5f2f70c5fe51fde:c256:tp1of2"
    assert ns("kvtc", "0123456789abcdef" + "0" * 48) == "vllm:SmolLM2-135M-Instruct:215884f110da13a6:c256:tp1of2"
    ident = "/models/SmolLM2-135M-Instruct|torch.bfloat16|kvtc-0123456789abcdef-r16-s4|sha256"
    assert hashlib.sha256(ident.encode()).hexdigest()[:16] == "215884f110da13a6"


def test_unknown_key(store):
    _refused(
        {"codec": "identity", "store": store, "chunk_token": 128},
        "unknown key 'chunk_token'=128",
        "did you mean 'chunk_tokens'",
        "remove it or use one of",
    )


def test_extra_config_not_a_dict():
    _refused("ratio=16", "kv_connector_extra_config must be a JSON object", "'ratio=16'", "pass e.g.")


@pytest.mark.parametrize(
    "value,needle,fix",
    [
        ("abc", "ratio='abc' is not a number", "set ratio to a compression ratio"),
        (0, "ratio=0 is not a compression ratio above 1", "set ratio to a ratio the calibration has"),
        (-16, "ratio=-16 is not a compression ratio above 1", "set ratio to"),
        (True, "ratio=True is not a number", "set ratio to"),
    ],
)
def test_ratio_not_a_ratio(calibration, store, value, needle, fix):
    _refused({"calibration": str(calibration), "ratio": value, "store": store}, needle, fix)


def test_ratio_without_a_plan(calibration, store):
    """A ratio the calibration cannot serve used to start the engine and fail every save with a warning."""
    _refused(
        {"calibration": str(calibration), "ratio": 13, "store": store},
        "ratio=13 has no bit plan",
        str(calibration),
        "plans for 4, 8",
        "set ratio to one of those",
    )


@pytest.mark.parametrize(
    "value,needle",
    [
        ("abc", "chunk_tokens='abc' is not a whole number"),
        (1.5, "chunk_tokens=1.5 is not a whole number"),
        (0, "chunk_tokens=0 is not a positive number of tokens"),
        (-256, "chunk_tokens=-256 is not a positive number of tokens"),
    ],
)
def test_chunk_tokens_not_a_count(store, value, needle):
    _refused({"codec": "identity", "store": store, "chunk_tokens": value}, needle, "set chunk_tokens to a multiple")


def test_chunk_tokens_not_a_multiple_of_the_block_size(store):
    _refused(
        {"codec": "identity", "store": store, "chunk_tokens": 100},
        "chunk_tokens=100 is not a multiple of the engine's KV block size 16",
        "set chunk_tokens to a multiple of 16, such as 96",
    )


@pytest.mark.parametrize(
    "value,needle",
    [
        ("four", "sinks='four' is not a whole number"),
        (-1, "sinks=-1 is not a token count between 0 and chunk_tokens=256"),
        (300, "sinks=300 is not a token count between 0 and chunk_tokens=256"),
    ],
)
def test_sinks(store, value, needle):
    _refused({"codec": "identity", "store": store, "sinks": value}, needle, "set sinks to")


@pytest.mark.parametrize("value", ["zstd", 5, None])
def test_codec(store, value):
    _refused({"codec": value, "store": store}, f"codec={value!r} is not a codec", "set codec to 'kvtc'")


def test_kvtc_codec_without_calibration(store):
    _refused({"store": store}, "calibration=None is required by codec='kvtc'", "kvtc calibrate", "codec='identity'")


@pytest.mark.parametrize(
    "url,problem,fix",
    [
        ("", "store='' is not a store URL", "set store to file:///"),
        ("memory://", "store='memory://' is private to one process", "use file:///"),
        ("ftp://host/dir", "store='ftp://host/dir' cannot be opened", "'ftp'"),  # the fix: the store's list of schemes
        ("file://otherhost/dir", "store='file://otherhost/dir' cannot be opened", "use file:///absolute/path"),
        (
            "file:///tmp/kvtc-store?max_bytes=lots",
            "store='file:///tmp/kvtc-store?max_bytes=lots' cannot be opened",
            "max_bytes",
        ),
    ],
)
def test_store_url(url, problem, fix):
    _refused({"codec": "identity", "store": url}, problem, fix)


def test_store_directory_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    url = f"file://{blocker}/store"
    _refused({"codec": "identity", "store": url}, f"store={url!r} cannot be opened", "writable directory")


def test_calibration_missing(tmp_path, store):
    path = str(tmp_path / "nowhere.kvtc-calib")
    _refused(
        {"calibration": path, "store": store},
        f"calibration={path!r} cannot be used",
        "does not exist",
        "kvtc calibrate",
    )


def test_calibration_unreadable(tmp_path, store):
    path = tmp_path / "garbage.kvtc-calib"
    path.write_bytes(os.urandom(4096))
    _refused({"calibration": str(path), "store": store}, f"calibration={str(path)!r} cannot be used", "recreate it")


def test_calibration_of_another_model(calibration, store):
    """Refused at startup as a calibration of another model, naming both; RoPE is not blamed."""
    other = LlamaConfig(**tiny_models.COMMON, num_hidden_layers=3)
    msg = _refused(
        {"calibration": str(calibration), "ratio": 8, "store": store},
        f"calibration={str(calibration)!r}",
        "made for another model (tiny-llama",
        "the served model 'other-model'",
        "use a calibration made for this model",
        hf_config=other,
        model="other-model",
    )
    assert "RoPE" not in msg


def test_calibration_of_same_shape_other_rope(calibration, store):
    """Same KV shape, other rotation: this one is the RoPE's fault, and the message says so."""
    other = LlamaConfig(
        **tiny_models.COMMON, num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 5e5}
    )
    _refused(
        {"calibration": str(calibration), "ratio": 8, "store": store},
        "RoPE",
        "differs from the calibration's",
        "recalibrate",
        hf_config=other,
    )


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigError, match=r"ratio='x' is not a number"):
        ConnectorConfig(codec="identity", ratio="x")


def _kv_cache_config(*specs):
    """vLLM's own KV-cache configuration with one group per spec (layers named like vLLM names them)."""
    vkci = pytest.importorskip("vllm.v1.kv_cache_interface")
    groups = [vkci.KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec) for i, spec in enumerate(specs)]
    return vkci.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_kv_cache_groups_of_the_hybrid_manager():
    """Sliding-window groups keep their window (the layer holds window - 1 tokens), full-attention groups all."""
    import torch

    vkci = pytest.importorskip("vllm.v1.kv_cache_interface")
    from kvtc.integrations.vllm.groups import cache_groups

    common = {"num_kv_heads": 2, "head_size": 16, "dtype": torch.bfloat16}
    cfg = _kv_cache_config(
        vkci.SlidingWindowSpec(16, sliding_window=512, **common), vkci.FullAttentionSpec(16, **common)
    )
    slid, full = cache_groups(cfg, 16)
    assert (slid.window, slid.held, slid.layer_names) == (512, 511, ("model.layers.0.self_attn.attn",))
    assert (full.window, full.held, full.block_size) == (0, 0, 16)
    assert len(cache_groups(None, 128)) == 1  # no configuration: one group of every layer


def test_latent_and_recurrent_caches_are_refused():
    """MLA and state-space (Mamba) groups: refused at startup, naming the model and the fix."""
    import torch

    vkci = pytest.importorskip("vllm.v1.kv_cache_interface")
    from kvtc.integrations.vllm.groups import cache_groups

    mla = _kv_cache_config(vkci.MLAAttentionSpec(16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match=r"'m' uses multi-head latent attention .* without kv_transfer_config"):
        cache_groups(mla, 16, "'m'")
    mamba = _kv_cache_config(vkci.MambaSpec(16, shapes=((4, 8),), dtypes=(torch.float32,)))
    with pytest.raises(ConfigError, match=r"KV-cache group of kind MambaSpec .* serve this model without"):
        cache_groups(mamba, 16)


def test_chunk_longer_than_a_sliding_window():
    """A chunk must fit in what a sliding-window layer holds (window - 1 tokens): the fix names a size that does."""
    from kvtc.integrations.vllm.groups import check_chunk

    check_chunk(256, 128, (511, 0, 511))  # Gemma-3 with the default chunk: fits
    with pytest.raises(ConfigError, match=r"chunk_tokens=512 is longer than the 511 tokens .* such as 384"):
        check_chunk(512, 128, (511, 0))
    with pytest.raises(ConfigError, match=r"chunk_tokens=128 .* --block-size 64 .* no larger than 127"):
        check_chunk(128, 128, (127,))


def test_first_chunk_counts_its_raw_sinks(tmp_path, caplog):
    """The first chunk keeps its sinks raw; they count against its budget like every stored byte, so it is coded
    at the least compressing calibrated ratio r with sinks + (chunk - sinks) / r <= chunk / ratio (later chunks at
    the configured ratio); where none fits, the configured ratio with a warning naming the fix."""
    layout, rope = describe_model(tiny_models.llama())
    src = LowRankSource(layout.num_features, rank=8, seed=1)
    path = fit_calibration(
        layout, [(src.rows(512), src.rows(512))], Recipe(ratios=(4, 8, 16), dp_rows=256), rope=rope.to_dict()
    ).save(tmp_path / "cal.kvtc-calib")
    hf = tiny_models.llama()

    def first_and_later(ratio: float) -> tuple[float, float, int, int]:
        extra = {
            "calibration": str(path),
            "ratio": ratio,
            "chunk_tokens": 64,
            "sinks": 4,
            "store": f"file://{tmp_path}",
        }
        codecs = Codecs.for_model(ConnectorConfig.from_extra(extra), hf)
        first, later = codecs.codec(layout, True), codecs.codec(layout, False)
        return float(first.ratio), float(later.ratio), first.sinks, later.sinks

    assert first_and_later(4) == (8, 4, 4, 0)  # 4 + 60/8 = 11.5 <= 16; 60/4 alone would be 15 + 4 > 16
    assert first_and_later(8) == (16, 8, 4, 0)  # 4 + 60/16 = 7.75 <= 8
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvtc.vllm"):
        assert first_and_later(16) == (16, 16, 4, 0)  # the sinks alone fill 4/64 of the chunk: nothing fits
    assert "4 raw sinks do not fit a 64-token chunk at 1/16" in caplog.text and "Raise chunk_tokens" in caplog.text
