"""One gain on the full-attention keys' fixed-step components: does the next-token KL want them decoded larger or
smaller than their bins' midpoints?

Takes a Gemma-3-270M calibration of recipe r10 (the embedded default's), sets every fixed-step group of the
full-attention PCA group's key plans to decode at ``alpha · q · step`` (the rest unchanged) and writes the result
as a new calibration, to be scored with ``kvtc eval --calibration``. Plans with decode gains exist only at commit
009bb4e (calibration format version 7, reverted: BENCHMARKS.md "Decode gains for fixed-step groups"), so run this
and the eval with that commit's sources::

    git worktree add ../kvtc-009bb4e 009bb4e
    PYTHONPATH=../kvtc-009bb4e/src python benchmarks/key_gain.py .cache/calibrations/gemma3-sotu-pre2000-100000-r10.safetensors 1.05 k105.safetensors
    PYTHONPATH=../kvtc-009bb4e/src python -m kvtc eval --model gemma3 --calibration k105.safetensors --ratios 16,32 \\
        --no-baselines --no-ablations --no-conversation --no-retrieval
"""

from __future__ import annotations

import dataclasses
import sys

from kvtc.calibration import Calibration
from kvtc.quant import DROP, FIXED_TYPES


def main(argv: list[str]) -> int:
    src, alpha, out = argv[0], float(argv[1]), argv[2]
    kinds = argv[3].split(",") if len(argv) > 3 else ["keys"]
    cal = Calibration.load(src)
    sizes = [c.numel() for c in cal.grouping.columns(cal.layout)]
    full = sizes.index(min(sizes))  # Gemma-3: the 3 full-attention layers' group (768 features)
    plans = {}
    for key, by in cal.plans.items():
        plans[key] = {}
        for kind, pls in by.items():
            new = []
            for g, pl in enumerate(pls):
                if kind in kinds and g == full:
                    kept = [t for _, _, t in pl.groups() if t != DROP]
                    gains = tuple(alpha if t in FIXED_TYPES else 1.0 for t in kept)
                    pl = dataclasses.replace(pl, gains=gains if any(a != 1.0 for a in gains) else ())
                new.append(pl)
            plans[key][kind] = new
    print(dataclasses.replace(cal, plans=plans).save(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
