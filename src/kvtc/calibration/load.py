"""One way from what a user names to a :class:`Calibration`: the object itself, a file, or ``"default"``."""

from __future__ import annotations

import os
from typing import Any

from ..errors import CalibrationError
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


def load_calibration(
    source: Calibration | str | os.PathLike[str], model: Any = None, progress: bool = True
) -> Calibration:
    """The calibration ``source`` names: a :class:`Calibration` (returned as is), a calibration file's path, or
    ``"default"``: the embedded model's own (the ``r13`` recipe, built on first use and cached, one file per
    embedded model; see :func:`~kvtc.integrations.hf_calibrate.default_calibration`).

    ``model`` (optional) names the model it is for (hub id, local directory, ``"default"`` or an embedded model's
    name such as ``"gemma3"``; None is the default SmolLM2): ``"default"`` is refused for any model but an embedded
    one. Raises :class:`CalibrationError` for a missing, corrupt or foreign file.
    """
    if isinstance(source, Calibration):
        return source
    if isinstance(source, str) and source == DEFAULT_CALIBRATION:
        key = embedded_model_key("default" if model is None else model)
        if key is None:
            from ..assets import EMBEDDED_MODELS

            embedded = ", ".join(m.key for m in EMBEDDED_MODELS)
            raise CalibrationError(
                f"default calibrations are the embedded models' ({embedded}), not {model}'s; pass a calibration file "
                "made for that model (`kvtc calibrate --model ... --out FILE`, then --calibration FILE)"
            )
        from ..integrations.hf_calibrate import default_calibration

        return Calibration.load(default_calibration(progress=progress, model=key))
    if not isinstance(source, (str, os.PathLike)):
        raise CalibrationError(f"a calibration is a Calibration, a file path or 'default', not {type(source).__name__}")
    return Calibration.load(source)


__all__ = ["DEFAULT_CALIBRATION", "embedded_model_key", "is_default_model", "load_calibration"]
