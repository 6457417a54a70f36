"""``kvtc.eval``: quality lost against bytes saved, for kvtc and the KV compressors a user would otherwise pick.

* :mod:`~kvtc.eval.methods`: kvtc, FP8 E4M3, KIVI 2/4-bit, transformers' quanto / HQQ caches, StreamingLLM eviction;
* :mod:`~kvtc.eval.protocols`: storage round trip, simulated conversation, pass-key retrieval;
* :mod:`~kvtc.eval.greedy`: the greedy bit allocator of the DP-vs-greedy ablation;
* :mod:`~kvtc.eval.suite`: one run (:class:`EvalConfig`, :func:`run`); :mod:`~kvtc.eval.report`: JSON, table, plot.
"""

from ..lazy import lazy_attributes
from .config import EvalConfig

#: imported on first use (they need torch and transformers)
_LAZY = {
    **dict.fromkeys(("FP8", "KIVI", "KVTC", "Eviction", "Method", "Peer"), "methods"),
    **dict.fromkeys(("conversation", "passkey_prompts", "retrieval", "storage_roundtrip"), "protocols"),
    "run": "suite",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "EvalConfig",
    "Eviction",
    "FP8",
    "KIVI",
    "KVTC",
    "Method",
    "Peer",
    "conversation",
    "passkey_prompts",
    "retrieval",
    "run",
    "storage_roundtrip",
]
