"""The token map: a linear prediction of every layer's pre-RoPE keys and values from the token ids.

Whoever restores a reused prefix knows its token ids (it was found by them), and a token's K/V at every layer
depend in large part on the token itself and the few before it (layer 0's wholly: they are a function of the token
alone). A calibration may therefore carry a ridge regression from the model's input embeddings of tokens ``t``,
``t - 1`` … ``t - lags + 1`` (standardised) to the flattened K and V of token ``t``; the codec then codes each
middle token's K/V less that prediction, and adds it back on decode (:mod:`kvtc.codec.prediction`). On Gemma-3-270M
this cuts next-token KL at 64x by about 21%, on SmolLM2-135M by about 20% (BENCHMARKS.md); calibration keeps a map
only where it saves enough on held-out windows (:data:`MIN_GAIN`).

The map predicts the deviation of a token's K/V from the calibration rows' mean: on the rows it was fitted on its
predictions average to zero, so the residuals keep the rows' mean, where the PCA centres.

Tensors in a calibration file: ``tokens.mean`` and ``tokens.std`` float32 ``[lags · E]`` (the
standardisation of the features), ``tokens.keys`` and ``tokens.values`` int8 ``[lags · E, p]`` with
``tokens.keys.scale`` and ``tokens.values.scale`` float32 ``[p]`` (the map, column ``j`` being ``int8[:, j] ·
scale[j]``: :func:`quantize_weights`) and
``tokens.probe`` float32 ``[PROBE_ROWS, E]`` (the embedding rows :func:`probe_ids` names, to tell the model's
embeddings from another's). They are part of the calibration's hash: a blob decodes only with the map that
encoded it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CalibrationError, CalibrationMismatch

#: tokens each prediction reads: the token and the two before it (Gemma-3-270M's full-attention keys want the
#: previous tokens as an induction head does; a fourth and fifth overfit,
#: docs/studies/token-prediction.md)
LAGS = 3
#: ridge penalty, as a share of the mean diagonal of the standardised Gram matrix
RIDGE = 0.1
#: the least gain for which calibration keeps the map (``token_map="auto"``): the share of the distortion that
#: coding the residuals saves against coding the K/V, at the rate of :data:`GAIN_RATIO` by reverse water-filling over
#: the spectra of each layer's features in the held-out rows, sensitivity weighted (mean over keys and values). Below
#: it the map is not worth its file size and its product per encode and decode. Measured per layer, Gemma-3-270M's
#: saves 43% and SmolLM2-135M's 44%; over the whole p x p spectrum (the measurement before recipe r16, at 5%: minutes
#: of eigendecompositions) the same maps save 21% and 13% (next-token KL at 64x: -21% and -20%), so the whole's 5% lies at 10-17%
#: per layer on the two, and 15% sits there. The energy the map removes is no guide: about half on both
MIN_GAIN = 0.15
#: the compression ratio at which the gain is measured
GAIN_RATIO = 32
#: the most calibration tokens the map is fitted on (the calibration's first windows; their rows wait in memory, at
#: float16, until the map is solved)
MAX_FIT_TOKENS = 20_000
#: embedding rows stored to recognise the model's embeddings
PROBE_ROWS = 8
#: the least standard deviation of a feature the fit keeps (a constant feature's): a file's ``tokens.std`` below it
#: (as float32) was not written by the fit, and dividing by it could overflow the prediction
STD_FLOOR = 1e-6
KINDS = ("keys", "values")
#: the largest magnitude of a stored weight: int8, symmetric (-127 ... 127)
WEIGHT_LEVELS = 127
#: the largest column scale a file may hold: a weight stays within float16's range, as it was when maps were float16
#: (a forged scale near float32's largest would dequantize to inf)
MAX_WEIGHT_SCALE = float(torch.finfo(torch.float16).max) / WEIGHT_LEVELS


def quantize_weights(w: torch.Tensor, dim: int = 0, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as a calibration stores a map's weights: int8 of ``w``'s shape and a float32 scale per column (the
    weights along ``dim`` share one: ``w``'s shape less ``dim``), each weight rounded to the nearest step. The
    scale is the column's largest magnitude over :data:`WEIGHT_LEVELS` (1 for an all-zero column, at least the
    smallest normal float32), or with ``power_of_two`` the power of two at or above it (weights already on such a
    grid round to themselves: a map held as float32 is stored again as the same bytes). Half the bytes of float16;
    for the token map the rounding (at most half a step, 0.4% of a column's largest weight) raises the
    sensitivity-weighted energy the map leaves by 0.02% on SmolLM2-135M's held-out K/V
    (docs/studies/calibration-size.md), and a blob encodes and decodes with the same rounded map."""
    w = w.double()
    top = w.abs().amax(dim, keepdim=True)
    scale = (top / WEIGHT_LEVELS).clamp_min(torch.finfo(torch.float32).tiny)
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = torch.where(top > 0, scale, torch.ones_like(scale)).float()
    q = (w / scale.double()).round().clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)
    return q, scale.squeeze(dim)


def probe_ids(vocab: int) -> torch.Tensor:
    """The embedding rows a token map stores (:attr:`TokenMap.probe`): spread over the vocabulary."""
    return torch.linspace(0, vocab - 1, PROBE_ROWS).round().long()


def lagged(emb: torch.Tensor, ids: torch.Tensor, lags: int) -> torch.Tensor:
    """``[B, T, lags · E]`` float32: the input embeddings of each token and of the ``lags - 1`` before it (zeros
    before a sequence's first token), for ``ids`` ``[B, T]``."""
    e = emb.detach()[ids.to(emb.device)].float()
    parts = [e]
    for j in range(1, lags):
        parts.append(torch.nn.functional.pad(e[:, :-j], (0, 0, j, 0)) if e.shape[1] > j else torch.zeros_like(e))
    return torch.cat(parts, -1)


@dataclass
class TokenMap:
    """A calibration's token map (see the module docstring)."""

    lags: int
    vocab: int
    mean: torch.Tensor
    std: torch.Tensor
    #: per kind, the int8 ``[lags · E, p]`` map and its float32 ``[p]`` column scales (:func:`quantize_weights`)
    weights: dict[str, torch.Tensor]
    scales: dict[str, torch.Tensor]
    probe: torch.Tensor
    #: the held-out share of the (weighted) energy the map removed, per kind (statistics: not hashed)
    gain: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._cache: dict[tuple[str, str, Any], torch.Tensor] = {}

    @classmethod
    def from_weights(
        cls,
        lags: int,
        vocab: int,
        mean: torch.Tensor,
        std: torch.Tensor,
        weights: dict[str, torch.Tensor],
        probe: torch.Tensor,
        gain: dict[str, float] | None = None,
    ) -> TokenMap:
        """The map of float ``weights[kind]`` ``[lags · E, p]``, stored as a calibration stores it
        (:func:`quantize_weights`)."""
        stored = {k: quantize_weights(w) for k, w in weights.items()}
        q, s = {k: v[0] for k, v in stored.items()}, {k: v[1] for k, v in stored.items()}
        return cls(lags, vocab, mean, std, q, s, probe, dict(gain or {}))

    @property
    def dim(self) -> int:
        """The embedding width ``E``."""
        return int(self.probe.shape[1])

    def validate(self, features: int) -> None:
        f = self.lags * self.dim
        if not 1 <= self.lags <= 16 or not 1 <= self.vocab <= 1 << 24 or self.probe.shape != (PROBE_ROWS, self.dim):
            raise CalibrationError("token map: lags, vocabulary or probe rows out of range; the file is corrupt")
        for name, t, shape, dtype in (
            ("mean", self.mean, (f,), torch.float32),
            ("std", self.std, (f,), torch.float32),
            ("probe", self.probe, (PROBE_ROWS, self.dim), torch.float32),
            *((kind, self.weights.get(kind), (f, features), torch.int8) for kind in KINDS),
            *((f"{kind} scale", self.scales.get(kind), (features,), torch.float32) for kind in KINDS),
        ):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                raise CalibrationError(f"token map {name} must be {dtype} {list(shape)}; the file is corrupt")
            if t.numel() and not all(math.isfinite(float(x)) for x in torch.aminmax(t)):  # NaN propagates
                raise CalibrationError(f"token map {name} is not finite; the file is corrupt")
        if not all(bool((self.scales[k] <= MAX_WEIGHT_SCALE).all()) for k in KINDS):
            raise CalibrationError(
                f"token map column scales must be at most {MAX_WEIGHT_SCALE:.4g}; the file is corrupt: rebuild the "
                "calibration (`kvtc calibrate`)"
            )
        if not bool((self.std >= torch.tensor(STD_FLOOR, dtype=torch.float32)).all()):
            raise CalibrationError(
                f"token map standard deviations must be positive, at least {STD_FLOOR:g} (the fit's floor); the "
                "file is corrupt: rebuild the calibration (`kvtc calibrate`)"
            )

    # ------------------------------------------------------------------ file
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"tokens.mean": self.mean, "tokens.std": self.std, "tokens.probe": self.probe}
        out.update({f"tokens.{k}": self.weights[k] for k in KINDS})
        out.update({f"tokens.{k}.scale": self.scales[k] for k in KINDS})
        return {n: t.contiguous() for n, t in out.items()}

    def meta(self) -> dict[str, Any]:
        return {"lags": self.lags, "vocab": self.vocab, "gain": {k: round(v, 6) for k, v in self.gain.items()}}

    @classmethod
    def from_parts(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> TokenMap:
        return cls(
            lags=int(meta["lags"]),
            vocab=int(meta["vocab"]),
            mean=tensors["tokens.mean"],
            std=tensors["tokens.std"],
            weights={k: tensors[f"tokens.{k}"] for k in KINDS},
            scales={k: tensors[f"tokens.{k}.scale"] for k in KINDS},
            probe=tensors["tokens.probe"],
            gain={str(k): float(v) for k, v in dict(meta.get("gain", {})).items()},
        )

    def columns(self, cols: torch.Tensor) -> TokenMap:
        """The map of the features ``cols`` only (a tensor-parallel shard's)."""
        return TokenMap(
            self.lags, self.vocab, self.mean, self.std, {k: w[:, cols] for k, w in self.weights.items()},
            {k: s[cols] for k, s in self.scales.items()}, self.probe, dict(self.gain),
        )  # fmt: skip

    # ------------------------------------------------------------------ use
    def check_embeddings(self, emb: Any) -> torch.Tensor:
        """``emb`` (the model's input embedding table ``[vocab, E]``) checked to be the one the map was fitted
        with; raises :class:`~kvtc.errors.CalibrationMismatch` otherwise."""
        if not isinstance(emb, torch.Tensor) or emb.dim() != 2:
            raise CalibrationMismatch(
                "this calibration codes K/V less a prediction from the token ids and needs the model's input "
                "embeddings: pass embeddings=model.get_input_embeddings().weight"
            )
        if tuple(emb.shape) != (self.vocab, self.dim):
            raise CalibrationMismatch(
                f"the embeddings given are {list(emb.shape)}, the calibration's token map was fitted on "
                f"[{self.vocab}, {self.dim}]: another model; use a calibration made for this model"
            )
        rows = emb.detach()[probe_ids(self.vocab).to(emb.device)].float().cpu()
        err = float((rows - self.probe).norm() / self.probe.norm().clamp_min(1e-30))
        if not err <= 1e-2:  # bf16 / fp16 copies of the same weights differ by < 0.5%
            raise CalibrationMismatch(
                "the embeddings given are not the ones the calibration's token map was fitted on (another model or "
                "fine-tune); use a calibration made for this model"
            )
        return emb.detach()

    def features(self, emb: torch.Tensor, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``[B, T, lags · E]`` standardised features of ``ids`` ``[B, T]`` on ``device``; ids outside the
        vocabulary raise :class:`~kvtc.errors.CalibrationMismatch`."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise CalibrationMismatch(
                f"token ids lie outside the model's vocabulary of {self.vocab}: they are not this model's tokens"
            )
        x = lagged(emb, ids, self.lags).to(device)
        return (x - self._on("mean", device)) / self._on("std", device)

    def predict(self, x: torch.Tensor, kind: str, cols: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., len(cols)]`` float32: the prediction of features ``cols`` (default: all) of ``kind`` from
        standardised features ``x`` ``[..., lags · E]``."""
        w = self._on(kind, x.device)
        if cols is not None:
            w = w[:, cols.to(x.device)]
        return x @ w

    def _on(self, name: str, device: torch.device) -> torch.Tensor:
        """A float32 copy of a tensor on ``device`` (a kind's map: its int8 weights times their column scales),
        made once."""
        key = (name, str(device), None)
        if key not in self._cache:
            if name in KINDS:
                w = self.weights[name].to(device=device, dtype=torch.float32)
                self._cache[key] = w * self.scales[name].to(device=device, dtype=torch.float32)
            else:
                self._cache[key] = getattr(self, name).to(device=device, dtype=torch.float32)
        return self._cache[key]


class TokenMapFit:
    """Streams windows (token ids and their K/V rows) into the moments a :class:`TokenMap` is solved from, in two
    parts: a map solved on either part predicts the other's rows out of sample (cross-fitting), and the second
    part's second moments give the gain of the first part's map on rows it was not fitted on (:meth:`gain`)."""

    def __init__(self, emb: torch.Tensor, features: int, lags: int = LAGS, block: int | None = None) -> None:
        self.emb, self.lags, self.features = emb.detach(), lags, features
        #: the gain's spectra are those of consecutive blocks of this many features (a layer's: the covariance's
        #: diagonal blocks), or of all features at once (None)
        self.block = features if block is None else block
        if self.block < 1 or features % self.block:
            raise CalibrationError(f"token map: blocks of {block} features do not tile {features}")
        f = lags * emb.shape[1] + 1
        self.parts = [self._zero(f), self._zero(f)]  # fitting, held out

    def _zero(self, f: int) -> dict[str, Any]:
        out: dict[str, Any] = {"m": torch.zeros(f, f, dtype=torch.float64), "n": 0}
        for k in KINDS:
            out[k] = torch.zeros(f, self.features, dtype=torch.float64)
            out[f"{k}.sum"] = torch.zeros(self.features, dtype=torch.float64)
            out[f"{k}.sq"] = torch.zeros(self.features, dtype=torch.float64)
        return out

    def _yy(self, part: dict[str, Any], k: str, y: torch.Tensor) -> None:
        """Add the rows' second moments within each block: ``[blocks, block, block]``."""
        yb = y.reshape(y.shape[0], -1, self.block).transpose(0, 1)  # [blocks, n, block]
        yy = (yb.transpose(1, 2) @ yb).double()
        part[f"{k}.yy"] = yy if f"{k}.yy" not in part else part[f"{k}.yy"] + yy

    def add(self, ids: torch.Tensor, rows: dict[str, torch.Tensor], first: int, held_out: bool = False) -> None:
        """One window: ``ids`` ``[T]`` and its ``rows[kind]`` ``[T - first, p]`` (the rows of tokens ``first``
        onwards)."""
        x = lagged(self.emb, ids[None], self.lags)[0, first:].cpu()
        a = torch.cat([x, torch.ones(x.shape[0], 1)], 1)
        part = self.parts[int(held_out)]
        part["m"] += (a.T @ a).double()
        part["n"] += a.shape[0]
        for k in KINDS:
            y = rows[k].float().cpu()
            part[k] += (a.T @ y).double()
            part[f"{k}.sum"] += y.double().sum(0)
            part[f"{k}.sq"] += y.double().square().sum(0)
            if held_out:  # the held-out rows' second moments, for the gain's spectra
                self._yy(part, k, y)

    @staticmethod
    def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
        return {key: sum(p[key] for p in parts) for key in parts[0] if key in parts[1]}

    def _solve(self, part: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], Any]:
        """(mean, std, weights per kind [F, p] float64, transform to the standardised design [z, 1])."""
        n, m = part["n"], part["m"]
        if n < 2:
            raise CalibrationError("the token map needs at least two rows to fit; calibrate on more tokens")
        f = m.shape[0] - 1
        mu = m[-1, :f] / n
        var = (m.diagonal()[:f] / n - mu.square()).clamp_min(0)
        sd = var.sqrt().clamp_min(STD_FLOOR)
        t = torch.zeros(f + 1, f + 1, dtype=torch.float64)  # [x, 1] @ t = [(x - mu) / sd, 1]
        t[:f, :f] = torch.diag(1 / sd)
        t[f, :f] = -mu / sd
        t[f, f] = 1
        g = t.T @ m @ t
        g += RIDGE * g.diagonal().mean() * torch.eye(f + 1, dtype=torch.float64)
        chol = torch.linalg.cholesky(g)
        w = {k: torch.cholesky_solve(t.T @ part[k], chol) for k in KINDS}
        # the intercept row is the predictions' mean over the fitting rows (the standardised features average to
        # zero there): dropping it leaves the residuals centred on the rows' mean
        return mu, sd, {k: v[:f] for k, v in w.items()}, t

    def gain(self, scale: dict[str, torch.Tensor | None] | None = None) -> dict[str, float]:
        """Per kind, the share of the distortion that coding the held-out rows less the map's prediction (the map
        fitted on the other windows) saves against coding the rows, at :data:`GAIN_RATIO` (reverse water-filling
        over the spectra of each one's blocks about the fitting rows' mean, features weighted by ``scale[kind]``),
        and the share of their energy the map removes (``"{kind} energy"``). The blocks (a layer's features each,
        as calibration sets them) keep the measurement at a layer's size: the whole ``p x p`` spectrum costs minutes
        of eigendecompositions on a wide model and tells the same keep-or-leave."""
        fit, test = self.parts
        if test["n"] == 0:
            raise CalibrationError("no held-out window to measure the token map on; calibrate on more tokens")
        _, _, w, t = self._solve(fit)
        a_m = t.T @ test["m"] @ t  # sum over held-out rows of [z, 1]^T [z, 1]
        f = a_m.shape[0] - 1
        n = test["n"]
        out = {}
        nb, b = self.features // self.block, self.block
        for k in KINDS:
            ybar = fit[f"{k}.sum"] / fit["n"]
            s_y = test[f"{k}.sum"]
            # per block (features i, j of one block), sums over rows of (y - ybar)(y - ybar)^T, of z^T (y - ybar)
            # and of (z w)^T (z w)
            yb, sb = ybar.reshape(nb, b), s_y.reshape(nb, b)
            outer = lambda u, v: u[:, :, None] * v[:, None, :]  # noqa: E731
            cyy = test[f"{k}.yy"] - outer(yb, sb) - outer(sb, yb) + n * outer(yb, yb)
            czy = ((t.T @ test[k])[:f] - torch.outer(a_m[f, :f], ybar)).reshape(f, nb, b).transpose(0, 1)
            wb = w[k].reshape(f, nb, b).transpose(0, 1)  # [blocks, F, b]
            cross = wb.transpose(1, 2) @ czy
            crr = cyy - cross - cross.transpose(1, 2) + wb.transpose(1, 2) @ (a_m[:f, :f] @ wb)
            s = scale.get(k) if scale else None
            if s is not None:
                d = s.double().reshape(nb, b)
                cyy, crr = cyy * outer(d, d), crr * outer(d, d)
            bits = 16 * self.features / GAIN_RATIO
            d_rows = water_filling(torch.linalg.eigvalsh(cyy.float() / n).double().reshape(-1), bits)
            d_res = water_filling(torch.linalg.eigvalsh(crr.float() / n).double().reshape(-1), bits)
            out[k] = 1 - d_res / max(d_rows, 1e-30)
            trace = lambda c: c.diagonal(dim1=1, dim2=2).sum()  # noqa: E731
            out[f"{k} energy"] = float(1 - trace(crr) / trace(cyy).clamp_min(1e-30))
        return out

    def result(self, vocab: int, gain: dict[str, float] | None = None, part: int | None = None) -> TokenMap:
        """The map solved on every window, fitting and held out (``part`` given: on that part's windows alone)."""
        mu, sd, w, _ = self._solve(self._merge(self.parts) if part is None else self.parts[part])
        probe = self.emb[probe_ids(vocab).to(self.emb.device)].float().cpu()
        return TokenMap.from_weights(self.lags, vocab, mu.float(), sd.float(), w, probe, gain)


def water_filling(eigenvalues: torch.Tensor, bits: float) -> float:
    """The distortion of reverse water-filling ``bits`` over independent Gaussian components of variances
    ``eigenvalues``: ``sum(min(ev, theta))`` with ``sum(max(0, log2(ev / theta) / 2)) = bits``."""
    ev = eigenvalues.double().clamp_min(1e-20)
    lo, hi = float(ev.min()) * 1e-12, float(ev.max())
    for _ in range(200):  # bisection on log(theta)
        mid = (lo * hi) ** 0.5
        if float((0.5 * torch.log2(ev / mid)).clamp_min(0).sum()) > bits:
            lo = mid
        else:
            hi = mid
    return float(ev.clamp_max(hi).sum())


__all__ = ["LAGS", "MIN_GAIN", "PROBE_ROWS", "TokenMap", "TokenMapFit", "lagged", "probe_ids", "quantize_weights"]
