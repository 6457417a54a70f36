"""Study: cap the rate ladder's coarsest rung at target x CEIL (the default ladder reaches target x 8).

``python studies/ladder_ceiling.py MODEL TEXTS CEILS RATIOS [WINDOWS]``, e.g. ``gemma3 wikipedia-tuning 8,2 32,64 16``:
the storage round trip of ``kvtc eval`` on the default calibration, KIVI 2-bit once, kvtc per ceiling and ratio;
prints KL mean / p90 / max / copy tokens and writes ladder-ceiling-MODEL-TEXTS.json.
"""

import json
import os
import sys
import time

import torch

if os.environ.get("THREADS"):
    torch.set_num_threads(int(os.environ["THREADS"]))
from kvtc import assets
from kvtc.calibration.artifact import ratio_key
from kvtc.codec import tiers
from kvtc.eval.config import EvalConfig
from kvtc.eval.methods import KIVI, KVTC
from kvtc.eval.protocols import storage_roundtrip
from kvtc.eval.suite import _load_calibration

model_name, texts, ceils = sys.argv[1], sys.argv[2], [float(c) for c in sys.argv[3].split(",")]
ratios = [float(r) for r in sys.argv[4].split(",")]
nwin = int(sys.argv[5]) if len(sys.argv) > 5 else 16
orig = tiers.ladder_rungs


def capped(ceil):
    def rungs(cal, target):
        if cal.queries is None:
            return None
        kept = []
        for r in sorted(float(x) for x in cal.plans):
            if target / tiers.LADDER_SPAN <= r <= target * ceil and (not kept or r >= kept[-1] * tiers.LADDER_STEP):
                kept.append(r)
        if len(kept) > tiers.MAX_RUNGS or not any(r < target for r in kept) or not any(r > target for r in kept):
            return None
        return tuple(ratio_key(r) for r in kept)

    return rungs


model, tok = assets.load_model(model_name)
cfg = EvalConfig(model=model_name, progress=False)
cal, _ = _load_calibration(cfg)
emb = model.get_input_embeddings().weight
windows = assets.token_windows(tok, assets.corpus(texts), 2048 + 256 + 1, nwin, seed=0)
out = {}
# KIVI 2-bit reference once
t0 = time.time()
res = storage_roundtrip(model, windows, [KIVI(2)], 2048)
out["KIVI 2-bit"] = res["KIVI 2-bit"].summary()
print("kivi done", time.time() - t0, flush=True)
for ceil in ceils:
    tiers.ladder_rungs = capped(ceil) if ceil != tiers.LADDER_SPAN else orig
    methods = [KVTC(cal, r, embeddings=emb) for r in ratios]
    res = storage_roundtrip(model, windows, methods, 2048)
    for m in methods:
        s = res[m.label].summary()
        out[f"{m.label} ceil{ceil:g}"] = s
        print(
            f"{m.label} ceil {ceil:g}: ratio {s['ratio']:.2f} kl {s['kl']:.5f} p90 {s['kl_p90']:.5f} max {s['kl_max']:.5f} copy {s.get('copy_kl', 0):.5f}",
            flush=True,
        )
    print("variant done", ceil, time.time() - t0, flush=True)
k = out["KIVI 2-bit"]
print(f"KIVI2 kl {k['kl']:.5f} p90 {k['kl_p90']:.5f} max {k['kl_max']:.5f} copy {k.get('copy_kl', 0):.5f}")
json.dump(out, open(f"ladder-ceiling-{model_name}-{texts}.json", "w"), indent=1)
