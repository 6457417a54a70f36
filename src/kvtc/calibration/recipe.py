"""The calibration recipe: every choice a calibration is made with, in one frozen value.

A :class:`Recipe` holds what :func:`~kvtc.calibration.fit.fit_calibration` (PCA and bit plans) and
:func:`~kvtc.integrations.hf_calibrate.calibrate_model` (corpus sampling, sensitivity measurement) decide; the
data they work on (rows, model, texts, RoPE, model id, corpus notes) is passed beside it. Two calibrations of equal
recipes on the same data, built on the same kind of CPU with the same software, are the same calibration: same
tensors, same plans, same content hash. Across CPUs the float reductions of the model's forward pass and of the PCA
differ in the last bits, so an independently rebuilt calibration has another content hash and does not decode
blobs the first one encoded (``CalibrationMismatch``): copy the calibration file instead.

The recipes of the embedded default's cached calibrations have names (:data:`RECIPES`): ``r16`` is ``Recipe()``,
``r16u`` ``Recipe(sensitivity="none")``; :attr:`Recipe.name` finds it (``tokens`` aside: the cached file names carry
the token count), so a new default recipe is a new name and a new file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import CalibrationError
from ..layout import PCAGrouping
from ..quant import DROP, TYPE_NAMES
from .dp import DEFAULT_DP_ROWS, DEFAULT_SIZES, DEFAULT_TYPES
from .pca import DEFAULT_OVERSAMPLE, DEFAULT_POWER_ITERS, DEFAULT_RANK_CAP

#: target ratios of a calibration; one basis serves all of them (the paper's 8/16/32/64 and points between,
#: so that the quality-vs-bytes curve is dense where users choose: entropy coding stores about 1.12-1.15x
#: more, so the 7, 7.5 and 8 targets store about 7.9x, 8.4x and 9x)
R10_RATIOS: tuple[float, ...] = (6, 7, 7.5, 8, 10, 12, 16, 24, 32, 48, 64)
#: r11 adds the tiers of the token-adaptive rates (half and 1.5 times each of 8, 12, 16, 24, 32, 48, 64:
#: :mod:`kvtc.codec.tiers`) that the ladder lacked
R12_RATIOS: tuple[float, ...] = (4, *R10_RATIOS[:7], 18, 24, 32, 36, 48, 64, 72, 96)
#: r13: cheap low tiers (:func:`kvtc.codec.tiers.tier_targets`: where a target's plain plan is lossy, its low tier
#: at up to 192x; Gemma-3-270M's 24x codes 12x/144x, 32x and 48x 12x/192x, 64x 16x/192x)
DEFAULT_RATIOS: tuple[float, ...] = (*R12_RATIOS, 144, 192)
#: weight of the values' relative error against the keys' in the joint split. Measured on SmolLM2-135M
#: (docs/studies/kv-split.md): value errors cost more next-token KL than key errors of the same
#: relative size, and weight 2 picks the split with the least KL at 8x and 16x.
DEFAULT_VALUE_WEIGHT = 2.0
#: share of a ratio's budget kept for what its plan's stored bits, measured on held-out calibration rows, leave
#: out: the positions and header and the distance between the calibration's text and the coded one (with 5%,
#: Gemma-3-270M's plans stored 0.2-0.5% below their 8x, 16x and 24x targets on Wikipedia windows,
#: docs/studies/history.md, "Quality vs bytes on Gemma-3-270M")
STORED_HEADROOM = 0.05
#: sensitivity weights below this share of the mean are raised to it (a feature the loss barely feels still
#: gets some precision: the gradient is measured on a few windows and is noisy where it is small)
DEFAULT_SENSITIVITY_FLOOR = 0.01
#: windows of the calibration corpus whose loss gradients measure the sensitivity, and their shape
DEFAULT_SENSITIVITY_WINDOWS = 8
SENSITIVITY_CONTEXT = 2048
SENSITIVITY_CONTINUATION = 256
#: the values each choice of a recipe may take (the first is the default)
CHOICES: dict[str, tuple[str, ...]] = {
    # the PCA: exact up to 8,192 features ("auto"), streamed covariance ("exact"), subspace iteration ("randomized")
    "method": ("auto", "exact", "randomized"),
    # how the PCA weighs features: by the loss's measured sensitivity ("fisher", ours) or not at all ("none": the
    # paper's plain squared error, the eval's ablation)
    "sensitivity": ("fisher", "none"),
    # record each attention head's mean pre-RoPE query over the calibration windows and a map predicting each query
    # from its token's own key ("keys", ours: the encoder's token-adaptive rates rank tokens by the attention the
    # newest tokens' predicted queries give them, kvtc.codec.tiers) or neither ("none")
    "queries": ("keys", "none"),
    # the precision of the calibration's forward pass (the K/V rows): the model's own matrix products in bfloat16
    # under autocast ("bfloat16", ours: 1.7-3x faster on CPUs with bf16 instructions, K/V within 0.4% of float32's,
    # docs/studies/calibration-speed.md) or as the model runs ("model")
    "forward": ("bfloat16", "model"),
    # code each token's K/V less a linear prediction from its token ids (kvtc.calibration.token_map): fit the map
    # and keep it where it saves enough distortion on held-out windows ("auto", ours) or never ("off")
    "token_map": ("auto", "off"),
}
SENSITIVITIES = CHOICES["sensitivity"]
#: the fields of older recipes (r9-r15) that the current one no longer has, each with the one value that is now its
#: only behaviour: a calibration that records another value was made with a removed choice and is refused
RETIRED: dict[str, str] = {
    "kv_split": "joint",
    "split_errors": "relative",
    "rate": "stored",
    "coder": "gauss",
    "sensitivity_resolution": "feature",
    "sensitivity_labels": "text",
    "sampling": "spread",
}
#: calibration size of the embedded default (the paper used ~160K tokens for 8B models)
DEFAULT_TOKENS = 100_000
#: tokens per calibration window (the paper used documents of 1K–32K tokens)
DEFAULT_WINDOW_TOKENS = 1024
#: positions at the start of every window left out of the calibration: the codec's attention sinks
#: (:data:`kvtc.codec.DEFAULT_SINKS`), which are never compressed and so must not shape the basis
DEFAULT_CALIBRATION_SINKS = 4


@dataclass(frozen=True)
class Recipe:
    """Every choice of a calibration (see the module's constants for each default's reason).

    Fitting (:func:`~kvtc.calibration.fit.fit_calibration`): ``ratios`` (target ratios, one bit plan each; kept
    sorted), ``grouping`` (which features share a PCA), ``rank_cap``, ``method``, ``power_iters``, ``oversample``
    (the PCA), ``dp_rows`` (rows the DP measures errors on), ``sizes`` and ``types`` (group sizes and quantization
    type codes the DP may use), ``value_weight`` (of the values' relative error against the keys' where K and V
    share a ratio's bits), ``seed``.

    Collecting (:func:`~kvtc.integrations.hf_calibrate.calibrate_model`): ``tokens`` (calibration rows),
    ``window`` (tokens per window), ``sinks`` (positions of each window left out); ``sensitivity``
    (``"fisher"`` weighs features by the loss's sensitivity, ``"none"`` does not) measured on
    ``sensitivity_windows`` windows of ``sensitivity_context`` + ``sensitivity_continuation`` tokens, one weight per
    feature, floored at ``sensitivity_floor``; ``queries`` (``"keys"``: record each head's mean query and the
    key-to-query map for the encoder's token-adaptive rates; ``"none"``); ``token_map`` (``"auto"``: fit a map from
    the token ids to the K/V on windows of the corpus and code each token less its prediction where that saves at
    least :data:`~kvtc.calibration.token_map.MIN_GAIN` of the distortion on held-out windows; ``"off"``);
    ``forward``.

    Older recipes (r9-r15) and files (versions 1-10) are refused: rebuild.
    """

    ratios: tuple[float, ...] = DEFAULT_RATIOS
    grouping: PCAGrouping = PCAGrouping()
    rank_cap: int = DEFAULT_RANK_CAP
    method: str = "auto"
    power_iters: int = DEFAULT_POWER_ITERS
    oversample: int = DEFAULT_OVERSAMPLE
    dp_rows: int = DEFAULT_DP_ROWS
    sizes: tuple[int, ...] = DEFAULT_SIZES
    types: tuple[int, ...] = DEFAULT_TYPES
    value_weight: float = DEFAULT_VALUE_WEIGHT
    sensitivity: str = "fisher"
    sensitivity_floor: float = DEFAULT_SENSITIVITY_FLOOR
    sensitivity_windows: int = DEFAULT_SENSITIVITY_WINDOWS
    sensitivity_context: int = SENSITIVITY_CONTEXT
    sensitivity_continuation: int = SENSITIVITY_CONTINUATION
    queries: str = "keys"
    token_map: str = "auto"
    forward: str = "bfloat16"
    tokens: int = DEFAULT_TOKENS
    window: int = DEFAULT_WINDOW_TOKENS
    sinks: int = DEFAULT_CALIBRATION_SINKS
    seed: int = 0

    def __post_init__(self) -> None:
        ratios = _numbers("ratios", self.ratios, "target compression ratios, e.g. ratios=(8, 16)")
        if not ratios or not all(math.isfinite(r) and r > 1 for r in ratios):
            _bad("ratios", self.ratios, "give one or more target compression ratios above 1, e.g. ratios=(8, 16)")
        object.__setattr__(self, "ratios", tuple(sorted(set(ratios))))
        if not isinstance(self.grouping, PCAGrouping):
            _bad("grouping", self.grouping, "pass a kvtc.layout.PCAGrouping, e.g. PCAGrouping('layers', 1)")
        for name in (
            "rank_cap",
            "dp_rows",
            "tokens",
            "window",
            "sensitivity_windows",
            "sensitivity_context",
            "sensitivity_continuation",
        ):
            _integer(self, name, 1)
        for name in ("power_iters", "oversample", "sinks", "seed"):
            _integer(self, name, 0)
        sizes = _numbers("sizes", self.sizes, "group sizes, e.g. sizes=(1, 16, 64)")
        if not sizes or not all(isinstance(s, int) and s > 0 for s in sizes):
            _bad("sizes", self.sizes, "give positive whole group sizes, e.g. sizes=(1, 16, 64)")
        object.__setattr__(self, "sizes", tuple(sizes))
        types = _numbers("types", self.types, "quantization type codes, e.g. kvtc.calibration.plan.PAPER_TYPES")
        known = [c for c in TYPE_NAMES if c != DROP]
        if not types or not all(isinstance(t, int) and t in known for t in types):
            _bad("types", self.types, f"give quantization type codes among {known} (kvtc.quant; dropping is implied)")
        object.__setattr__(self, "types", tuple(types))
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                _bad(name, getattr(self, name), f"use one of {', '.join(allowed)}")
        for name in ("value_weight", "sensitivity_floor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                _bad(name, v, "give a positive finite number")
        if not 1e-3 <= self.value_weight <= 1e3:
            _bad("value_weight", self.value_weight, "give a weight of values against keys between 0.001 and 1000")
        if self.window <= self.sinks:
            _bad("window", self.window, f"a calibration window must be longer than the sinks ({self.sinks})")
        if not self.window <= self.tokens <= 1 << 32:
            _bad("tokens", self.tokens, f"calibrate on at least one window ({self.window} tokens) and at most 2**32")

    @property
    def name(self) -> str | None:
        """The name of this recipe among :data:`RECIPES` (whatever its ``tokens``), or None."""
        for name, recipe in RECIPES.items():
            if dataclasses.replace(self, tokens=recipe.tokens) == recipe:
                return name
        return None

    def replace(self, **changes: Any) -> Recipe:
        """This recipe with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (a calibration records its recipe in its statistics)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(
            ratios=list(self.ratios),
            sizes=list(self.sizes),
            types=[TYPE_NAMES[t] for t in self.types],
            grouping=self.grouping.to_dict(),
        )
        return out


def check_recorded(recorded: Any, source: Any) -> None:
    """Refuse a calibration whose recorded recipe (``stats["recipe"]``, free-form: anything but an object is left
    alone) holds a choice the current :class:`Recipe` does not have, as a :class:`CalibrationError` that says to
    rebuild it. A retired field (:data:`RETIRED`) that holds what is now the only behaviour is accepted."""
    if not isinstance(recorded, dict):
        return
    for name, value in recorded.items():
        allowed = (RETIRED[name],) if name in RETIRED else CHOICES.get(name)
        if allowed is not None and not (isinstance(value, str) and value in allowed):
            raise CalibrationError(
                f"{source}: the calibration was made with recipe choice {name}={_shown(value)}, which this kvtc no "
                f"longer has (it has {name}={allowed[0]!r}); older recipes (r9-r15) are refused: rebuild it "
                "(`kvtc calibrate --model ... --out FILE`, or delete the cached file of an embedded default: it is "
                "rebuilt on first use)"
            )


def _shown(value: Any) -> str:
    return repr(value[:40]) if isinstance(value, str) else f"a {type(value).__name__}"


def _bad(name: str, value: Any, fix: str) -> None:
    raise CalibrationError(f"recipe field {name}={value!r} is not valid: {fix}")


def _numbers(name: str, value: Any, what: str) -> list[Any]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        _bad(name, value, f"give a sequence of {what}")
    out = list(value)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in out):
        _bad(name, value, f"give a sequence of {what}")
    return out


def _integer(recipe: Recipe, name: str, least: int) -> None:
    v = getattr(recipe, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        _bad(name, v, f"give a whole number of at least {least}")


#: named recipes: the embedded default's cached calibrations are made with these (the file name carries the name).
#: r16 (the default): one forward pass over the calibration windows, in bfloat16 (``forward="bfloat16"``), feeds the
#: token map (cross-fitted on its first windows), the PCA, the DP rows and the recorded queries; the windows' plans
#: by the rate ladder, each token less its token-map prediction where that pays, fixed-step planes sized under their
#: components' Gaussians, Fisher-weighted features; r16u without the weighting (the eval's ablation). What each
#: earlier recipe (r9 to r15) added, and why r16 replaced them: docs/studies/history.md and
#: docs/studies/calibration-speed.md. Older recipes (r9-r15) and files (versions 1-10) are refused: rebuild.
RECIPES: dict[str, Recipe] = {"r16": Recipe(), "r16u": Recipe(sensitivity="none")}
DEFAULT_RECIPE = "r16"
UNWEIGHTED_RECIPE = "r16u"

__all__ = ["DEFAULT_RATIOS", "DEFAULT_RECIPE", "RECIPES", "Recipe", "UNWEIGHTED_RECIPE"]
