"""Calibration: PCA bases and DP bit plans fitted once per model, stored as a safetensors artifact."""

from ..lazy import moved_attributes
from .artifact import Calibration, ratio_key
from .dp import Plan, allocate, allocate_for_error, budget_for_ratio
from .fit import fit_calibration, sensitivity_scales
from .pca import PCAResult, fit_pca
from .recipe import DEFAULT_RATIOS, RECIPES, Recipe

__all__ = [
    "DEFAULT_RATIOS",
    "RECIPES",
    "Calibration",
    "PCAResult",
    "Plan",
    "Recipe",
    "allocate",
    "allocate_for_error",
    "budget_for_ratio",
    "fit_calibration",
    "fit_pca",
    "ratio_key",
    "sensitivity_scales",
]


#: moved up to the integrations, which know the models: an alias (with a DeprecationWarning) for one release
__getattr__ = moved_attributes(__name__, {"load_calibration": "kvtc.integrations.hf_calibrate"})
