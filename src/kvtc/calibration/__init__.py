"""Calibration: PCA bases and DP bit plans fitted once per model, stored as a safetensors artifact."""

from .artifact import Calibration, ratio_key
from .dp import Plan, allocate, allocate_for_error, budget_for_ratio
from .fit import DEFAULT_RATIOS, fit_calibration, sensitivity_scales
from .pca import PCAResult, fit_pca

__all__ = [
    "DEFAULT_RATIOS",
    "Calibration",
    "PCAResult",
    "Plan",
    "allocate",
    "allocate_for_error",
    "budget_for_ratio",
    "fit_calibration",
    "fit_pca",
    "ratio_key",
    "sensitivity_scales",
]
