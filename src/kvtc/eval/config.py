"""What one ``kvtc eval`` run measures (:class:`EvalConfig`) and its defaults: plain values, importable without
torch, so that ``kvtc --help`` stays fast."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: evaluation text: disjoint from the calibration corpus (pre-2000 speeches) and from the Wikipedia articles kvtc's
#: choices were tuned on (``kvtc.assets.WIKIPEDIA_TUNING_TITLES``)
DEFAULT_TEXTS = "wikipedia-heldout"
DEFAULT_CONTEXT = 2048
DEFAULT_CONTINUATION = 256
#: enough windows for a worst case: the report gives each window's KL, the maximum and the 90th percentile
DEFAULT_WINDOWS = 16
#: tokens of calibration rows collected for the ablation calibrations (per-layer PCA, greedy allocator, the
#: paper's quantization types)
DEFAULT_ABLATION_TOKENS = 16_320
DEFAULT_RETRIEVAL_LENGTHS = (1024, 2048, 4096)
DEFAULT_RETRIEVAL_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_RETRIEVAL_PROMPTS = 50
DEFAULT_CONVERSATION_TOKENS = 1024
#: RULER-style needle prompts: context lengths (those above the model's context are left out), prompts per kind
#: and length, kvtc targets
DEFAULT_NEEDLE_LENGTHS = (4096, 8192)
DEFAULT_NEEDLE_PROMPTS = 6
PEER_BACKENDS = ("quanto", "hqq")
#: the classic pass-key haystack (repeated filler); "text" hides the needle in the evaluation text
DEFAULT_HAYSTACK = "filler"


#: the kvtc targets an eval measures by default (those the calibration plans): the paper's 8x to 64x and the
#: halfway points; a calibration plans more (4x to 192x: the rate ladder's rungs), which ``ratios=()`` measures
DEFAULT_RATIOS: tuple[float, ...] = (8, 16, 24, 32, 48, 64)


@dataclass
class EvalConfig:
    """What one run measures. ``quick``: one window, kvtc 16x and KIVI 2-bit, storage round trip only."""

    model: str = "default"
    calibration: str | None = None  # path; default: the embedded default's calibration
    texts: Sequence[str] = (DEFAULT_TEXTS,)
    windows: int = DEFAULT_WINDOWS
    context: int = DEFAULT_CONTEXT
    continuation: int = DEFAULT_CONTINUATION
    sinks: int = 4
    window: int = 128
    ratios: Sequence[float] | None = None  # kvtc targets; default: DEFAULT_RATIOS the calibration plans; () all
    baselines: bool = True
    peers: Sequence[str] = PEER_BACKENDS
    eviction_ratios: Sequence[float] = (8, 16, 32)
    ablations: bool = True
    ablation_tokens: int = DEFAULT_ABLATION_TOKENS
    ablation_ratios: Sequence[float] = (8, 16, 32)
    conversation: bool = True
    conversation_tokens: int = DEFAULT_CONVERSATION_TOKENS
    conversation_ratios: Sequence[float] = (16, 32)
    retrieval: bool = True
    retrieval_prompts: int = DEFAULT_RETRIEVAL_PROMPTS
    retrieval_lengths: Sequence[int] = DEFAULT_RETRIEVAL_LENGTHS
    retrieval_depths: Sequence[float] = DEFAULT_RETRIEVAL_DEPTHS
    retrieval_ratios: Sequence[float] = (16, 32)
    retrieval_haystack: str = DEFAULT_HAYSTACK
    needles: bool = True
    needle_lengths: Sequence[int] = DEFAULT_NEEDLE_LENGTHS
    needle_prompts: int = DEFAULT_NEEDLE_PROMPTS
    needle_ratios: Sequence[float] = (16, 32, 64)
    device: str = "cpu"
    seed: int = 0
    progress: bool = True
    quick: bool = False

    @classmethod
    def quick_config(cls, **kw: Any) -> EvalConfig:
        base = dict(
            windows=1,
            ratios=(16,),
            baselines=True,
            peers=(),
            eviction_ratios=(),
            ablations=False,
            conversation=False,
            retrieval=False,
            needles=False,
            quick=True,
        )
        base.update(kw)
        return cls(**base)
