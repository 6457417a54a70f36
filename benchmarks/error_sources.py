"""Where kvtc's reconstruction error comes from: on held-out text of the calibration's genre and on the evaluation text.

The default calibration of the embedded model (100K tokens of pre-2000 State of the Union speeches) codes the middle
tokens of ``--windows`` windows of 2,048 tokens (sinks 4, recent window 128, as ``kvtc eval`` does). The squared
error of every ratio is split into its three orthogonal parts, each relative to the centred energy ``‖x − µ‖²``:

* outside basis: energy in directions the calibration's basis does not hold (it is cut to what its largest plan keeps);
* dropped: energy of basis components the ratio's plan gives no bits;
* quantization: what the int2 / int4 / fp8 groups lose;

next to the calibration's own prediction (its DP rows). Texts: State of the Union speeches from 2000 on (same genre,
disjoint from the calibration) and the Wikipedia sample (the windows ``kvtc eval`` scores, same seed).

``--wiki-tokens N`` (default 100,000; 0 skips it) also fits a calibration of the same size on Wikipedia documents
that hold none of the scored windows, and codes the same windows with it: how much of the error on Wikipedia is the
calibration's domain. Its file is kept in the cache for ``kvtc eval --calibration``.
Writes benchmarks/results/error_sources.json and the ``error_sources`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import _report
from kvtc import assets
from kvtc.calibration import Calibration
from kvtc.calibration.artifact import ratio_key
from kvtc.codec import Codec
from kvtc.eval.protocols import _prefill
from kvtc.eval.suite import DEFAULT_CONTEXT, DEFAULT_CONTINUATION
from kvtc.integrations.hf import extract_slice
from kvtc.integrations.hf_calibrate import default_calibration
from kvtc.quant import DROP

TEXTS = {"sotu-2000on": "speeches from 2000 on (held out, same genre)", "wikipedia": "Wikipedia (the eval text)"}
SINKS, WINDOW = 4, 128
SHOWN = (8.0, 16.0, 32.0)


def decompose(cal: Calibration, ratio: float, kind: str, x: torch.Tensor, xhat: torch.Tensor) -> dict[str, float]:
    """Squared-error parts of middle-token rows ``x`` ``[n, p]`` and their reconstruction ``xhat``."""
    if len(cal.pcas[kind]) != 1:
        raise SystemExit("error_sources handles one PCA group (the default global grouping)")
    pca = cal.pcas[kind][0]
    plan = cal.plans[ratio_key(ratio)][kind][0]
    xc = x.double() - pca.mean.double()
    coeffs = xc @ pca.basis.double().T
    energy = float(xc.square().sum())
    outside = energy - float(coeffs.square().sum())
    dropped = float(coeffs[:, plan.num_components :].square().sum())
    for start, size, qtype in plan.groups():
        if qtype == DROP:
            dropped += float(coeffs[:, start : start + size].square().sum())
    total = float((x.double() - xhat.double()).square().sum())
    return {
        "energy": energy,
        "outside": max(outside, 0.0),
        "dropped": dropped,
        "quantization": max(total - max(outside, 0.0) - dropped, 0.0),
        "total": total,
    }


def heldout_wikipedia(tok, windows: torch.Tensor) -> list[str]:
    """Wikipedia documents that hold none of ``windows`` (token id rows)."""
    import numpy as np

    probes = [np.asarray(w[:64], dtype=np.int64).tobytes() for w in windows.tolist()]
    keep = []
    for doc in assets.corpus("wikipedia"):
        ids = np.asarray(tok(doc, add_special_tokens=False, verbose=False)["input_ids"], dtype=np.int64).tobytes()
        if not any(p in ids for p in probes):
            keep.append(doc)
    return keep


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="error_sources")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--wiki-tokens", type=int, default=100_000)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model, tok = assets.load_model("default")
    path = default_calibration(progress=False)
    cals = {"speeches (default)": Calibration.load(path)}
    length = DEFAULT_CONTEXT + DEFAULT_CONTINUATION + 1
    # the same windows as `kvtc eval` (length context + continuation + 1, seed 0); their context is coded
    windows = {text: assets.token_windows(tok, assets.corpus(text), length, args.windows, seed=0) for text in TEXTS}
    if args.wiki_tokens:
        from kvtc.integrations.hf_calibrate import Recipe, calibrate_model

        # held out from every window `kvtc eval` scores by default (8), not only the ones coded here
        scored = assets.token_windows(tok, assets.corpus("wikipedia"), length, max(8, args.windows), seed=0)
        wpath = assets.cache_dir() / "calibrations" / f"smollm2-wikipedia-heldout-{args.wiki_tokens}.safetensors"
        if wpath.exists():
            cals["Wikipedia (held out)"] = Calibration.load(wpath)
        else:
            docs = heldout_wikipedia(tok, scored)
            cal = calibrate_model(
                model,
                tok,
                docs,
                Recipe(tokens=args.wiki_tokens),
                model_id="smollm2",
                corpus={"name": "wikipedia-heldout", "documents": len(docs)},
                progress=False,
            )
            wpath.parent.mkdir(parents=True, exist_ok=True)
            cal.save(wpath)
            cals["Wikipedia (held out)"] = cal
    sums: dict[tuple[str, str, float, str], dict[str, float]] = {}
    for text in TEXTS:
        for ids in windows[text]:
            kv = extract_slice(_prefill(model, ids[:DEFAULT_CONTEXT]), model)
            T = kv.num_tokens
            for cname, cal in cals.items():
                if cname != "speeches (default)" and text != "wikipedia":
                    continue
                for r in sorted(float(x) for x in cal.plans):
                    codec = Codec(cal, r, sinks=SINKS, window=WINDOW)
                    out = codec.decode(codec.encode(kv))
                    for kind in ("keys", "values"):
                        x = getattr(kv, kind)[:, SINKS : T - WINDOW].reshape(-1, kv.layout.num_features)
                        xhat = getattr(out, kind)[:, SINKS : T - WINDOW].reshape(-1, kv.layout.num_features)
                        parts = decompose(cal, r, kind, x, xhat)
                        acc = sums.setdefault((cname, text, r, kind), dict.fromkeys(parts, 0.0))
                        for k, v in parts.items():
                            acc[k] += v
    rows = []
    for (cname, text, r, kind), s in sums.items():
        e = s["energy"]
        pred = cals[cname].stats.get("predicted_relative_error", {}).get(ratio_key(r), {}).get(kind, [None])[0]
        rows.append(
            {
                "calibration": cname,
                "text": text,
                "ratio": r,
                "kind": kind,
                "outside_basis": s["outside"] / e,
                "dropped": s["dropped"] / e,
                "quantization": s["quantization"] / e,
                "total": s["total"] / e,
                "predicted_total": pred,
                "structural_share": (s["outside"] + s["dropped"]) / max(s["total"], 1e-30),
            }
        )
    result = {
        "command": _report.command(),
        "machine": _report.machine(),
        "calibration": path.name,
        "calibrations": {k: {"fingerprint": c.fingerprint, "corpus": c.corpus} for k, c in cals.items()},
        "windows": args.windows,
        "texts": TEXTS,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _report.publish("error_sources", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        "### Where the reconstruction error comes from (SmolLM2-135M)",
        "",
        f"`{result['command']}` — {result['machine']['date']}, {result['windows']} windows of 2,048 tokens per text "
        f"(the middle tokens: sinks 4 and the last 128 stay raw). Squared error of the coded tokens as a share of their "
        f'centred energy ‖x − µ‖², split into its orthogonal parts; "predicted" is the calibration\'s own estimate '
        f"on its DP rows. Calibrations: the default (100K tokens of speeches before 2000) and, for comparison, one of "
        f"the same size on Wikipedia documents that hold none of the windows `kvtc eval` scores.",
        "",
        "| calibration | coded text | target | kind | outside basis | dropped by the plan | quantization | total | "
        "predicted | outside + dropped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    pct = lambda v: "–" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    for r in result["rows"]:
        if r["ratio"] not in SHOWN:
            continue
        lines.append(
            f"| {r['calibration']} | {TEXTS.get(r['text'], r['text'])} | {r['ratio']:g}× | {r['kind']} | "
            f"{pct(r['outside_basis'])} | "
            f"{pct(r['dropped'])} | {pct(r['quantization'])} | {pct(r['total'])} | "
            f"{pct(r['predicted_total'])} | {100 * r['structural_share']:.0f}% of total |"
        )
    lines += ["", "All ratios: `benchmarks/results/error_sources.json`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
