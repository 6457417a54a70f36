"""From what a user names to a :class:`Calibration`: the object itself or a file (:func:`open_calibration`), and
which names mean an embedded model's default calibration. ``"default"`` itself is built from the model on first use:
the integrations resolve it (:func:`kvtc.integrations.hf_calibrate.load_calibration`)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import CalibrationError
from ..lazy import moved_attributes
from .artifact import Calibration

#: the name of an embedded model's default calibration (built on first use and cached)
DEFAULT_CALIBRATION = "default"


def embedded_model_key(name: Any) -> str | None:
    """The key (``"smollm2"``, ``"gemma3"``) of the embedded model ``name`` names (``"default"``, a key or a model
    id such as ``"gemma-3-270m"``, any case; see :func:`kvtc.assets.embedded_model`), or None for any other model."""
    from .. import assets

    embedded = assets.embedded_model(str(name)) if isinstance(name, (str, os.PathLike)) else None
    return None if embedded is None else embedded.key


def is_default_model(name: Any) -> bool:
    """True when ``name`` names an embedded model (one with a default calibration): ``"default"`` (SmolLM2),
    ``"smollm2"``, ``"gemma3"`` or their model ids."""
    return embedded_model_key(name) is not None


def open_calibration(source: Calibration | str | os.PathLike[str]) -> Calibration:
    """The calibration ``source`` names: a :class:`Calibration` (returned as is) or a calibration file's path.
    Raises :class:`CalibrationError` for a missing, corrupt or foreign file, and for ``"default"``, which the
    integrations resolve (:func:`kvtc.integrations.hf_calibrate.load_calibration`: it builds the embedded model's
    calibration on first use)."""
    if isinstance(source, Calibration):
        return source
    if isinstance(source, str) and source == DEFAULT_CALIBRATION:
        raise CalibrationError(
            "'default' names an embedded model's calibration, built from the model on first use: resolve it with "
            "kvtc.integrations.hf_calibrate.load_calibration('default', model=...) and pass the Calibration or its file"
        )
    if not isinstance(source, (str, os.PathLike)):
        raise CalibrationError(f"a calibration is a Calibration, a file path or 'default', not {type(source).__name__}")
    return Calibration.load(source)


#: moved up to the integrations, which know the models: an alias (with a DeprecationWarning) for one release
__getattr__ = moved_attributes(__name__, {"load_calibration": "kvtc.integrations.hf_calibrate"})


__all__ = ["DEFAULT_CALIBRATION", "embedded_model_key", "is_default_model", "open_calibration"]
