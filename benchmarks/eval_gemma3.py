"""Quality vs bytes on the second embedded model, Gemma-3-270M (15 sliding-window layers holding their newest
511 tokens, 3 full-attention layers): ``kvtc eval --model gemma3`` with its default calibration.

Writes benchmarks/results/eval_gemma3.{json,md,png}, the ``eval_gemma3`` section of BENCHMARKS.md (a summary) and
its full report, docs/results/eval_gemma3.md. Extra arguments go to ``kvtc eval``; ``--render`` re-renders the saved
result.
"""

from __future__ import annotations

import sys

from eval_smollm2 import bench

if __name__ == "__main__":
    sys.exit(bench("eval_gemma3", "Quality vs bytes on Gemma-3-270M", sys.argv[1:], ["--model", "gemma3"]))
