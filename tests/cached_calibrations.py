"""Small real calibrations of the embedded models for the tests, built once per environment and cached.

A test calibration is ``calibrate_model`` on the pre-2000 speeches with a recipe smaller than the default's, saved
under ``<cache>/calibrations/`` with a name made of the model, a digest of the recipe and the file format version (a
changed recipe or format builds a new file) and reused by every later run. Processes building the same file wait for
each other (a file lock)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kvtc import assets
from kvtc.calibration.meta import FORMAT_VERSION
from kvtc.calibration.recipe import Recipe
from kvtc.integrations.hf_calibrate import calibrate_model


def cached_calibration(key: str, recipe: Recipe, loaded: tuple[Any, Any] | None = None) -> Path:
    """The path of embedded model ``key``'s test calibration of ``recipe``, built on first use (with ``loaded``,
    the model and tokenizer already in memory, else loaded here)."""
    digest = hashlib.sha256(json.dumps(recipe.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    path = assets.cache_dir() / "calibrations" / f"{key}-sotu-pre2000-test-{digest}-v{FORMAT_VERSION}.safetensors"
    with assets.file_lock(path.with_suffix(".lock")):
        if not path.is_file():
            embedded = assets.embedded_model(key)
            model, tok = loaded or assets.load_model(key)
            texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
            cal = calibrate_model(
                model, tok, texts, recipe, model_id=embedded.name, corpus={"name": "sotu-pre2000"}, progress=False
            )
            cal.save(path)
    return path
