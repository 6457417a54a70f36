"""Calibration time and peak memory of the embedded models' default calibrations on CPU, stage by stage.

    python benchmarks/calibration_cpu.py [--models smollm2,gemma3] [--tokens N] [--threads 2] [--baseline REV]
                                         [--curve 10000,20000,40000] [--keep]

Each calibration is built from scratch (the default recipe, the pre-2000 State of the Union speeches) in a fresh
process, which reports the seconds of each stage, its peak resident memory (``ru_maxrss``), the saved file's size and
the time to load it back (``Calibration.load``: read, validated, hashed): the sensitivity pass,
the one forward pass over the calibration windows (collect), the token map's fit, the PCA (covariance and
eigendecomposition, less the forwards) and the DP bit allocation. ``--baseline REV``: the same for the kvtc of that
git revision of this repository (its ``src``, taken with ``git archive`` into a temporary folder), in the same run,
so that before and after come from one machine and day. ``--curve``: calibrations at those token counts, each
scored by ``kvtc eval`` (next-token KL at 16x and 64x on its default held-out windows): the quality against the
calibration's size. ``--keep``: the calibrations of this code at the default token count are saved where the embedded
defaults are cached (``kvtc.integrations.hf_calibrate.default_calibration_path``), so the run also builds them.
Writes benchmarks/results/calibration_cpu.json, the ``calibration_cpu`` section of BENCHMARKS.md and its full form,
docs/results/calibration_cpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, machine, table, update_section, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: the stages a calibration records, in order (``pca`` less ``collect``: the covariance and eigendecomposition)
STAGES = ("sensitivity", "collect", "token map", "pca", "dp", "total")

WORKER = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
from kvtc import assets
from kvtc.integrations.hf_calibrate import Recipe, calibrate_model
key, tokens, out = sys.argv[1], int(sys.argv[2]), sys.argv[4]
embedded = assets.embedded_model(key)
model, tok = assets.load_model(key)
texts = assets.sotu_texts(before=assets.SOTU_SPLIT_YEAR)
t0 = time.perf_counter()
cal = calibrate_model(model, tok, texts, Recipe(tokens=tokens), model_id=embedded.name, corpus={"name": "sotu-pre2000"},
                      progress=False)
wall = time.perf_counter() - t0
cal.save(out)
t1 = time.perf_counter()
type(cal).load(out)  # read, checked and hashed as every user of the file does (the file in the page cache)
load = time.perf_counter() - t1
s = dict(cal.stats["seconds"])
print(json.dumps({
    "wall": wall, "seconds": s,
    "sensitivity": (cal.corpus.get("sensitivity") or {}).get("seconds"),
    "token map": (cal.corpus.get("token_map") or {}).get("seconds"),
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "file_mb": __import__("os").path.getsize(out) / 1e6, "load_s": load,
    "recipe": cal.stats.get("recipe", {}).get("tokens"), "hash": cal.hash,
}))
"""


def run_worker(src: Path, model: str, tokens: int, threads: int, out: str) -> dict[str, Any]:
    """One calibration in a fresh process importing kvtc from ``src``; its stage seconds and peak memory."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, model, str(tokens), str(threads), out],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"calibration of {model} failed:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    s = r["seconds"]
    # the PCA's clock runs while the rows stream in: less the forwards, and less the token map's fit where it ran
    # among them (recorded as seconds["token_map"]; before, the map had forward passes of its own, outside)
    mapped = s.get("token_map", 0.0)
    stages = {
        "sensitivity": r.get("sensitivity"),
        "collect": s.get("collect"),
        "token map": r.get("token map"),
        "pca": s["pca"] - s["collect"] - mapped if s.get("pca") is not None and s.get("collect") is not None else None,
        "dp": s.get("dp"),
        "total": s.get("total"),
    }
    return {"stages": stages, "peak_rss_mb": round(r["peak_rss_mb"]), "wall": r["wall"], "hash": r["hash"],
            "file_mb": round(r["file_mb"], 1), "load_s": round(r["load_s"], 2)}  # fmt: skip


def baseline_src(rev: str, tmp: Path) -> Path:
    """The ``src`` folder of git revision ``rev``, extracted into ``tmp``."""
    archive = tmp / "baseline.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), rev, "src"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "baseline", filter="data")
    return tmp / "baseline" / "src"


def eval_kl(model: str, calibration: str, out: Path) -> dict[str, float]:
    """``kvtc eval``'s next-token KL at 16x and 64x for ``calibration`` (its default held-out windows)."""
    subprocess.run(
        [sys.executable, "-m", "kvtc", "eval", "--model", model, "--calibration", calibration, "--ratios", "16,64",
         "--no-baselines", "--no-ablations", "--no-conversation", "--no-retrieval", "--no-progress", "--out", str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=True, capture_output=True,
    )  # fmt: skip
    rows = json.loads((out / "eval.json").read_text())["storage_roundtrip"]
    return {r["method"]: r["kl"] for r in rows if r["method"] in ("kvtc 16x", "kvtc 64x")}


def fmt(v: Any) -> str:
    return "" if v is None else f"{v:.0f}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--tokens", type=int, default=None, help="calibration tokens (default: the recipe's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline", metavar="REV", help="also calibrate with the kvtc of this git revision")
    ap.add_argument("--curve", default="", help="token counts to score with kvtc eval, comma separated")
    ap.add_argument("--keep", action="store_true", help="save this code's default calibrations into the asset cache")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from kvtc.calibration.recipe import DEFAULT_RECIPE, DEFAULT_TOKENS
    from kvtc.integrations.hf_calibrate import default_calibration_path

    tokens = args.tokens or DEFAULT_TOKENS
    models = [m for m in args.models.split(",") if m]
    result: dict[str, Any] = {"machine": machine(), "command": command(), "recipe": DEFAULT_RECIPE, "runs": []}
    rows, curve_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        base = baseline_src(args.baseline, tmp_path) if args.baseline else None
        for model in models:
            for label, src, n in (("now", ROOT / "src", tokens), *((("before", base, 100_000),) if base else ())):
                print(f"{model}: calibrating ({label}, {n:,} tokens)", file=sys.stderr, flush=True)
                keep = args.keep and label == "now" and n == DEFAULT_TOKENS
                out = default_calibration_path(model=model) if keep else tmp_path / f"{model}-{label}.safetensors"
                r = run_worker(src, model, n, args.threads, str(out))
                result["runs"].append({"model": model, "code": label, "tokens": n, **r})
                rows.append({"model": model, "code": args.baseline if label == "before" else "this", "tokens": f"{n:,}",
                             **{k: fmt(v) for k, v in r["stages"].items()}, "peak MB": r["peak_rss_mb"],
                             "file MB": f"{r['file_mb']:.0f}", "load s": f"{r['load_s']:.1f}"})  # fmt: skip
            for n in [int(t) for t in args.curve.split(",") if t]:
                path = str(tmp_path / f"{model}-{n}.safetensors")
                print(f"{model}: curve point {n:,} tokens", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                r = run_worker(ROOT / "src", model, n, args.threads, path)
                kl = eval_kl(model, path, tmp_path / f"eval-{model}-{n}")
                point = {"model": model, "tokens": n, "seconds": r["stages"]["total"], "kl": kl}
                result.setdefault("curve", []).append(point)
                curve_rows.append({"model": model, "tokens": f"{n:,}", "calibration s": fmt(r["stages"]["total"]),
                                   "KL 16x": f"{kl['kvtc 16x']:.4g}", "KL 64x": f"{kl['kvtc 64x']:.4g}"})  # fmt: skip
                print(f"  {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    write_json("calibration_cpu", result)
    m = result["machine"]
    head = (
        "### Calibration on CPU: the embedded models' default calibrations\n\n"
        f"The default recipe ({DEFAULT_RECIPE}), pre-2000 State of the Union speeches, each built from scratch in a "
        f"fresh process with {args.threads} torch threads; seconds per stage, peak resident memory, the file's size "
        "and the seconds `Calibration.load` takes to read, check and hash it (the file just written, in the page "
        "cache). "
        f"{m['cpu']}, {m['date']}. `{result['command']}`"
    )
    cols = ["model", "code", "tokens", *STAGES, "peak MB", "file MB", "load s"]
    md = [head, "", table(rows, cols)]
    if curve_rows:
        md += ["", "Quality against calibration tokens (`kvtc eval`, next-token KL on its default held-out windows):",
               "", table(curve_rows, ["model", "tokens", "calibration s", "KL 16x", "KL 64x"])]  # fmt: skip
    text = "\n".join(md)
    update_section("calibration_cpu", text)
    print(text)


if __name__ == "__main__":
    main()
