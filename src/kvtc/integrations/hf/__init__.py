"""Hugging Face transformers integration: everything kvtc knows about transformers models lives here.

* :mod:`.rope_probe`: a model's :class:`~kvtc.rope.RopeSpec`, read from its config and probed against its own
  rotation (:func:`rope_spec_from_config`).
* :mod:`.adapter`: :class:`ModelAdapter`, read once per model config (:func:`adapter_for`): the KV layout, the
  RoPE spec, ``DynamicCache`` -> :class:`~kvtc.layout.KVSlice` (:func:`extract_slice`) and back
  (:func:`rebuild_cache`, or layer by layer :func:`rebuild_cache_from_layers`), and the calibration check (:func:`check_model`).
* :mod:`.cache`: a ``DynamicCache`` to a kvtc blob and back (:func:`compress_cache`, :func:`restore_cache`), and
  blobs on disk (:func:`save_blob`, :func:`load_blob`).
"""

from .adapter import (
    DEFAULT_CONFIG_DTYPE,
    ModelAdapter,
    adapter_for,
    check_model,
    describe_model,
    extract_slice,
    is_hybrid,
    rebuild_cache,
    rebuild_cache_from_layers,
)
from .cache import DEFAULT_STORAGE_DTYPE, compress_cache, load_blob, restore_cache, save_blob
from .rope_probe import rope_spec_from_config

__all__ = [
    "DEFAULT_CONFIG_DTYPE",
    "DEFAULT_STORAGE_DTYPE",
    "ModelAdapter",
    "adapter_for",
    "check_model",
    "compress_cache",
    "describe_model",
    "extract_slice",
    "is_hybrid",
    "load_blob",
    "rebuild_cache",
    "rebuild_cache_from_layers",
    "restore_cache",
    "rope_spec_from_config",
    "save_blob",
]
