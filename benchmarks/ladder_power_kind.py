"""Should the rate ladder weigh tokens less steeply in full-attention layers than in sliding ones?

The ladder weighs a token's error in a layer by ``(attention it receives / the layer's mean) ** 2``
(:func:`kvtc.codec.tiers.ladder_weights`). SmolLM2 (full attention only) measured best at power 1, Gemma-3-270M
(15 sliding layers, 3 full) at power 2. One reading: a full-attention layer's future reads are harder to predict
from the newest queries (a later copy reaches anywhere), so its weights should be flatter, while a sliding layer's
readers are the next few hundred positions, which the newest queries predict. This study codes held-out windows
with the default calibration and the ladder as shipped, changing only the power of each kind of layer's weights:
``--variants full:sliding`` pairs, a power with the suffix ``n`` keeping each layer's mean weight that of power 2
(only the shape of the weights changes, not how many bytes the kind draws under the ladder's one price).

The score is ``kvtc eval``'s storage round trip (4 sinks, the 128 newest exact; next-token KL over 256 continuation
tokens) on Wikipedia windows (seed 23) and windows of the speeches from 2000 on (seed 11): text the eval does not
read. Writes benchmarks/results/NAME.json. Usage: ``python benchmarks/ladder_power_kind.py [--windows 6]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

import _heldout
import kvtc.codec.ladder as ladder
import kvtc.codec.tiers as tiers


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ladder_power_kind")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--variants", default="2:2,1n:2,1.5n:2,1:2", help="full:sliding powers ('n': mean kept)")
    ap.add_argument("--ratios", default="16,64")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--name", default="ladder_power_kind")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    variants = [tuple(v.split(":")) for v in args.variants.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    state: dict[str, Any] = {}
    original_errors, original_weights = ladder.errors, tiers.ladder_weights

    def errors(codec, kind, g, coeffs, pls, mass, middle, header, per_layer):  # noqa: ANN001, ANN202
        layers = tiers.group_layers(codec.calibration.columns[g], header.layout)
        sliding = all(header.layout.limit(int(i)) for i in layers)
        state["power"] = state["sliding"] if sliding else state["full"]
        return original_errors(codec, kind, g, coeffs, pls, mass, middle, header, per_layer)

    def weights(mass: torch.Tensor, power: float = tiers.LADDER_POWER) -> torch.Tensor:
        p = state["power"]
        if not p.endswith("n"):
            return original_weights(mass, float(p))
        w = original_weights(mass, float(p[:-1]))
        ref = original_weights(mass, tiers.LADDER_POWER)
        B, Lg = mass.shape[0], w.shape[1]
        scale = ref.reshape(B, -1, Lg).mean(1, keepdim=True) / w.reshape(B, -1, Lg).mean(1, keepdim=True).clamp_min(
            1e-30
        )
        return (w.reshape(B, -1, Lg) * scale).reshape(w.shape)

    def select(v: tuple[str, str]) -> str:
        state["full"], state["sliding"] = v
        return f"full {v[0]} sliding {v[1]}"

    kls, cal = _heldout.ladder_sweep(args.model, args.windows, variants, ratios, select, errors, weights)
    _heldout.write(args.name, t0, kls, calibration=cal.fingerprint)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
