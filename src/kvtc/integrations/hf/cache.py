"""Compress a transformers ``DynamicCache`` to bytes and restore it, ready for ``model.generate``.

``compress_cache(cache, model, codec | calibration+ratio) -> bytes`` extracts the cache's KV (keys pre-RoPE,
real layer indices, any batch size), casts it to the storage dtype (bfloat16 by default: the ratio is counted
against bf16, what a serving engine holds) and encodes it. ``restore_cache(blob, model, calibration)`` checks
that blob, calibration and model belong together, decodes, re-applies the model's RoPE and returns a fresh
``DynamicCache`` (in the model's dtype, on its device) that ``model(...)`` / ``model.generate(...,
past_key_values=...)`` continues from. ``save_blob`` / ``load_blob`` put a blob on disk atomically and
validate it on the way back.

What is and is not in a blob:

* Full-attention and sliding-window layers: every cached token of every KV layer. A sliding-window layer
  must still hold the whole sequence (a ``DynamicCache(config=...)`` drops tokens once the window is full;
  :func:`compress_cache` then raises :class:`~kvtc.errors.LayoutError` saying how to keep them). The restored
  cache trims those layers to their window exactly as the model would have.
* Hybrid models (linear attention / SSM layers): only the attention KV is coded. The recurrent and conv
  states of the linear layers are a fixed-size summary of the whole history that kvtc does not code; a
  restored cache without them would silently continue from "no history". :func:`restore_cache` therefore
  refuses a hybrid model unless ``linear_states=`` gives a cache holding those states (the one the blob was
  made from, or states the caller stored beside the blob), which are copied in.
* Token ids: stored only when the calibration carries a token map (the codec codes each token's K/V less a
  prediction from them: ``compress_cache(..., input_ids=)`` is then required). Either way, like any
  ``past_key_values``, the restored cache stands for the first ``tokens`` ids of the input the caller passes
  next. Left-padded batches need their real ``positions`` at compression and their attention mask at generation.
* Not stored: the attention mask.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from ...calibration.artifact import Calibration, ratio_key
from ...calibration.load import open_calibration
from ...codec import Codec, container
from ...errors import CalibrationError, CalibrationMismatch, LayoutError
from ...fileio import write_atomic
from ...layout import DTYPES
from .adapter import adapter_for

#: storage dtype of the KV in a blob (ratios are counted against it)
DEFAULT_STORAGE_DTYPE = "bfloat16"

__all__ = ["compress_cache", "restore_cache", "save_blob", "load_blob", "DEFAULT_STORAGE_DTYPE"]


def compress_cache(
    cache: Cache,
    model: PreTrainedModel,
    codec: Codec | None = None,
    *,
    calibration: Calibration | str | os.PathLike[str] | None = None,
    ratio: float = 16,
    positions: torch.Tensor | None = None,
    dtype: torch.dtype | str | None = DEFAULT_STORAGE_DTYPE,
    model_id: str = "",
    timings: dict[str, float] | None = None,
    input_ids: torch.Tensor | None = None,
) -> bytes:
    """Encode every KV layer of ``cache`` (filled by ``model``) into one kvtc blob.

    Give either a ready ``codec`` or a ``calibration`` (object or file) and a target ``ratio``; a calibration
    must have been made for this model (layout and RoPE are checked: :class:`~kvtc.errors.CalibrationMismatch`
    otherwise). ``positions``: int64 ``[batch, tokens]`` absolute positions (default ``arange(tokens)``; pass
    the real ones for left-padded batches). ``dtype``: storage dtype of the KV (default bfloat16; ``None``
    keeps the cache's, e.g. for a lossless float32 identity blob). ``timings`` collects the codec's stages.
    ``input_ids``: int ``[batch, tokens]``, the ids the cache was filled from; required when the calibration
    carries a token map (:attr:`~kvtc.codec.Codec.needs_token_ids`; the model's input embeddings are then used too).
    """
    if codec is None:
        if calibration is None:
            raise CalibrationError(
                "compress_cache needs a codec or a calibration; pass calibration=<file or Calibration> "
                "(the embedded default: kvtc.integrations.hf_calibrate.default_calibration())"
            )
        codec = Codec(open_calibration(calibration), ratio=ratio)
    elif calibration is not None:
        raise CalibrationError("pass either codec= or calibration=, not both")
    adapter = adapter_for(model)
    if codec.calibration is not None:
        adapter.check(codec.calibration)
    kv = adapter.extract(cache, positions=positions, model_id=model_id or _model_name(model))
    if dtype is not None:
        name = dtype if isinstance(dtype, str) else next((n for n, d in DTYPES.items() if d == dtype), None)
        if name not in DTYPES:
            raise LayoutError(f"storage dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if name != kv.layout.dtype:
            kv.keys = kv.keys.to(DTYPES[name])
            kv.values = kv.values.to(DTYPES[name])
            kv.layout = dataclasses.replace(kv.layout, dtype=name)
    if codec.needs_token_ids:
        codec.use_embeddings(model.get_input_embeddings().weight)
    return codec.encode(kv, timings=timings, token_ids=input_ids)


def restore_cache(
    blob: bytes,
    model: PreTrainedModel,
    calibration: Calibration | str | os.PathLike[str] | None = None,
    *,
    linear_states: Cache | None = None,
    timings: dict[str, float] | None = None,
) -> DynamicCache:
    """A fresh ``DynamicCache`` holding the KV of ``blob``, with ``model``'s RoPE re-applied, in the model's
    dtype and on its device.

    ``calibration``: the calibration the blob was encoded with (object or file; not needed for identity
    blobs). Checked before anything is decoded: the calibration's layout and RoPE against the model's
    (:meth:`~kvtc.calibration.artifact.Calibration.check_model`) and the blob's calibration hash against the
    calibration's (which fixes the blob's layout); an identity blob's layout against the model's.
    ``linear_states``: required for hybrid models (see the module docstring).
    Raises :class:`~kvtc.errors.FormatError` for a corrupt or truncated blob,
    :class:`~kvtc.errors.CalibrationMismatch` for a blob, calibration or model that do not belong together and
    :class:`~kvtc.errors.LayoutError` for an identity blob of another model.
    """
    header, _ = container.read_header(blob)
    adapter = adapter_for(model)
    if header.mode == "identity":
        adapter.check_layout(header.layout, "the blob")
        codec = Codec.identity()
    else:
        if calibration is None:
            raise CalibrationError(
                f"this blob was encoded with calibration {header.calibration[:16]}; "  # type: ignore[index]
                "pass calibration=<that calibration file>"
            )
        cal = open_calibration(calibration)
        adapter.check(cal)
        if header.calibration != cal.hash:
            raise CalibrationMismatch(
                f"the blob was encoded with calibration {str(header.calibration)[:16]}, not with "
                f"{cal.fingerprint}; restore it with the calibration that encoded it"
            )
        codec = Codec(cal, ratio=float(ratio_key(float(header.ratio or 16))))
        if codec.needs_token_ids:
            codec.use_embeddings(model.get_input_embeddings().weight)
    if adapter.hybrid and linear_states is None:
        raise LayoutError(
            "this hybrid model has linear-attention / SSM layers whose recurrent state a kvtc blob does not hold; "
            "pass linear_states=<a cache holding those states> (e.g. the cache the blob was made from)"
        )
    kv = codec.decode(blob, timings=timings)
    return adapter.rebuild(kv, model, linear_states=linear_states)


def save_blob(path: str | os.PathLike[str], blob: bytes) -> Path:
    """Write ``blob`` to ``path`` atomically, after checking it is a kvtc container (see :func:`write_atomic`).

    On any failure whatever was at ``path`` before is left untouched; the error is a
    :class:`~kvtc.errors.StoreError` (:class:`~kvtc.errors.FormatError` when ``blob`` is not a container)."""
    container.read_header(blob)  # refuse to put garbage where a good file may be
    return write_atomic(path, blob)


def load_blob(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a ``.kvtc`` file, with its container header validated (sections are checked on decode).
    Only a regular file is opened (never a FIFO or a device), and its header is read and checked before the rest."""
    return container.read_blob(path)


# ---------------------------------------------------------------------- helpers


def _model_name(model: Any) -> str:
    name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    return Path(name).name if name else ""
