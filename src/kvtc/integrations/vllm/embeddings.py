"""Where a served model's input embedding table lies in its checkpoint, read without loading the model.

A calibration with a token map (:mod:`kvtc.calibration.token_map`) codes each token's K/V less a prediction from the
input embeddings of its token ids, so the connector's codecs need the table the model was calibrated with. vLLM does
not hand the connector its weights; the table is read from the checkpoint's safetensors instead (metadata first: only
the one tensor is loaded, once per process).
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open


def checkpoint_dir(model: str | None) -> Path:
    """The local directory of ``model`` (a path, or a hub id already in the local Hugging Face cache)."""
    if not model:
        raise ValueError("the served model's checkpoint is not known")
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))
    except Exception:  # noqa: BLE001 - any failure means: not available offline
        raise ValueError(f"{model!r} is neither a local directory nor in the local Hugging Face cache") from None


def find_input_embeddings(model: str | None, shape: tuple[int, int]) -> tuple[str, str]:
    """``(file, tensor name)`` of the ``[vocab, E]`` input embedding table of ``model``'s checkpoint: a tensor of
    that shape whose name ends in ``embed_tokens.weight``, else one whose name holds ``embed``."""
    root = checkpoint_dir(model)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} holds no safetensors files")
    found: list[tuple[int, str, str]] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "embed" not in name or "position" in name:
                    continue
                if tuple(f.get_slice(name).get_shape()) == tuple(shape):
                    found.append((0 if name.endswith("embed_tokens.weight") else 1, str(file), name))
    if not found:
        raise ValueError(f"no input embedding table of shape {list(shape)} in {root}'s safetensors")
    _, file_name, tensor = min(found)
    return file_name, tensor


__all__ = ["checkpoint_dir", "find_input_embeddings"]
