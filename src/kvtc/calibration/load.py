"""One way from what a user names to a :class:`Calibration`: the object itself, a file, or ``"default"``."""

from __future__ import annotations

import os
from typing import Any

from ..errors import CalibrationError
from .artifact import Calibration

#: the name of the embedded default model's calibration (built on first use and cached)
DEFAULT_CALIBRATION = "default"


def is_default_model(name: Any) -> bool:
    """True when ``name`` names the embedded default model (``"default"``, ``"smollm2"`` or its id)."""
    from .. import assets

    return isinstance(name, (str, os.PathLike)) and str(name).lower() in (
        "default",
        "smollm2",
        assets.DEFAULT_MODEL.lower(),
    )


def load_calibration(
    source: Calibration | str | os.PathLike[str], model: Any = None, progress: bool = True
) -> Calibration:
    """The calibration ``source`` names: a :class:`Calibration` (returned as is), a calibration file's path, or
    ``"default"``: the embedded default model's (the ``r8`` recipe, built on first use and cached; see
    :func:`~kvtc.integrations.hf_calibrate.default_calibration`).

    ``model`` (optional) names the model it is for (hub id, local directory or ``"default"``): ``"default"`` is
    refused for any model but the embedded one, whose calibration it is. Raises :class:`CalibrationError` for a
    missing, corrupt or foreign file.
    """
    if isinstance(source, Calibration):
        return source
    if isinstance(source, str) and source == DEFAULT_CALIBRATION:
        if model is not None and not is_default_model(model):
            raise CalibrationError(
                f"the default calibration is the embedded SmolLM2's, not {model}'s; pass a calibration file made "
                "for that model (`kvtc calibrate --model ... --out FILE`, then --calibration FILE)"
            )
        from ..integrations.hf_calibrate import default_calibration

        return Calibration.load(default_calibration(progress=progress))
    if not isinstance(source, (str, os.PathLike)):
        raise CalibrationError(f"a calibration is a Calibration, a file path or 'default', not {type(source).__name__}")
    return Calibration.load(source)


__all__ = ["DEFAULT_CALIBRATION", "is_default_model", "load_calibration"]
