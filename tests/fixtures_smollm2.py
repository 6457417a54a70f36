"""Session fixtures for the SmolLM2 cache, CLI and vLLM tests: a small calibration and a held-out context.

The test calibration is the embedded default's recipe (r16: SmolLM2 on the pre-2000 speeches) on 16,384 tokens and
2 sensitivity windows where the default takes 100,000 and 8: a fresh clone builds it in about 2.5 minutes on 2 cores
where the default takes about 7 (the stages that do not shrink with the tokens, the eigendecompositions and the DP,
are most of it). It is built once into the asset cache (``cached_calibrations``) and every later run loads it. The
quality bounds asserted by the tests hold for it; the default's own quality is `kvtc eval`'s (BENCHMARKS.md). The
held-out context is a window of a speech from 2000 on. Values are memoised at module level, so test modules that
import these fixtures share one copy.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from cached_calibrations import cached_calibration
from kvtc import assets
from kvtc.calibration.artifact import Calibration
from kvtc.calibration.recipe import Recipe

#: the test calibration's recipe: the default's (r16) on fewer tokens and sensitivity windows
SMALL_RECIPE = Recipe(tokens=16_384, sensitivity_windows=2)
SMALL_CALIBRATION_TOKENS = SMALL_RECIPE.tokens
#: the acceptance context: 2,048 held-out tokens, then tokens scored teacher-forced
HELDOUT_CONTEXT = 2048
HELDOUT_SCORED = 32


@functools.lru_cache(maxsize=1)
def _small_calibration_path() -> Path:
    return cached_calibration("smollm2", SMALL_RECIPE)


@functools.lru_cache(maxsize=1)
def _small_calibration() -> Calibration:
    return Calibration.load(_small_calibration_path())


@functools.lru_cache(maxsize=1)
def _heldout_window(tokenizer_dir: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return assets.token_windows(
        tok, assets.sotu_texts(since=assets.SOTU_SPLIT_YEAR), HELDOUT_CONTEXT + HELDOUT_SCORED, 1, seed=0
    )


@pytest.fixture(scope="session")
def small_calibration_path() -> Path:
    """Path of the small SmolLM2 calibration (built once into the asset cache)."""
    return _small_calibration_path()


@pytest.fixture(scope="session")
def small_calibration() -> Calibration:
    return _small_calibration()


@pytest.fixture(scope="session")
def heldout(smollm2_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(context [1, 2048], continuation [1, 32])`` token ids of a held-out speech (2000 on)."""
    window = _heldout_window(str(smollm2_dir))
    return window[:, :HELDOUT_CONTEXT], window[:, HELDOUT_CONTEXT:]
