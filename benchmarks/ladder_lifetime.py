"""Should the rate ladder weigh a sliding-window token by how long it stays in its window?

A full-attention layer's token is read by every later query; a sliding-window layer's token only by the queries
until it leaves the window: a token ``d`` positions before the newest one is read by the next ``W - 1 - d``
queries of a layer that holds ``W`` tokens, so the oldest tokens such a layer holds are about to be dropped and an
error there costs few future reads. The ladder (:func:`kvtc.codec.tiers.ladder_weights`) weighs a token by the
attention the newest positions give it, which does not see that. This study multiplies a sliding layer's weight
by ``min(1, (W - 1 - d) / H)`` (the share of the next ``H`` queries that still read it; ``--variants`` lists the
horizons ``H``, ``W``: the window itself; the suffix ``n`` keeps each layer's mean weight, so only the shape of
the weights changes, not the bytes the sliding layers draw under the ladder's one price) and codes held-out windows
with the default calibration and the ladder as shipped otherwise.

The score is ``kvtc eval``'s storage round trip (4 sinks, the 128 newest exact; next-token KL over 256 continuation
tokens) on Wikipedia windows (seed 23) and windows of the speeches from 2000 on (seed 11): text the eval does not
read. Writes benchmarks/results/NAME.json. Usage: ``python benchmarks/ladder_lifetime.py [--windows 6]``.
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


def lifetime(T: int, start: int, m: int, limit: int, horizon: str) -> torch.Tensor:
    """``[m]``: the share of the next ``horizon`` queries that still read each middle token of a layer holding
    ``limit`` tokens (``W``: the window)."""
    d = (T - 1 - torch.arange(start, start + m)).double()
    h = float(limit if horizon == "W" else horizon)
    return ((limit - 1 - d) / h).clamp(0.0, 1.0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ladder_lifetime")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--variants", default="none,W,Wn,256")
    ap.add_argument("--ratios", default="64")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--name", default="ladder_lifetime")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    variants = args.variants.split(",")
    ratios = [float(r) for r in args.ratios.split(",")]
    state: dict[str, Any] = {}
    original_errors, original_weights = ladder.errors, tiers.ladder_weights

    def errors(codec, kind, g, coeffs, pls, mass, middle, header, per_layer):  # noqa: ANN001, ANN202
        layers = tiers.group_layers(codec.calibration.columns[g], header.layout)
        limits = [header.layout.limit(int(i)) for i in layers]
        state["factor"] = None
        v = state["variant"]
        if v != "none" and all(limits):
            start, m = middle
            keep = v.endswith("n")
            f = torch.stack([lifetime(mass.shape[2], start, m, lim, v.rstrip("n")) for lim in limits])  # [Lg, m]
            state["factor"] = (f, keep)
        return original_errors(codec, kind, g, coeffs, pls, mass, middle, header, per_layer)

    def weights(mass: torch.Tensor, power: float = tiers.LADDER_POWER) -> torch.Tensor:
        w = original_weights(mass, power)
        if state["factor"] is None:
            return w
        f, keep = state["factor"]
        B, Lg, m = mass.shape
        w3 = w.reshape(B, m, Lg).double()
        new = w3 * f.T[None]
        if keep:
            new = new * (w3.mean(1, keepdim=True) / new.mean(1, keepdim=True).clamp_min(1e-30))
        return new.reshape(w.shape).float()

    def select(v: str) -> str:
        state["variant"] = v
        return v

    kls, cal = _heldout.ladder_sweep(args.model, args.windows, variants, ratios, select, errors, weights)
    _heldout.write(args.name, t0, kls, calibration=cal.fingerprint)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
