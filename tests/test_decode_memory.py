"""Real memory of a decode: the peak resident memory a CPU decode adds is at most 1.5 x its decoded KV bytes (2 x batch
x tokens x features x dtype size) + 64 MiB, for every mode (identity, one plan, two tiers, the rate ladder, the token
map, sliding-window layouts, ``decode_layers``), so that ``max_decoded_bytes`` bounds what a decode takes.

One subprocess (one torch thread) fits small calibrations, encodes a blob of each mode (48 MiB of decoded KV; identity
96 MiB: a decode that holds its raw sections and its output at once, 2.5x, shows only past 64 MiB), then measures each
decode: after ``malloc_trim`` (freed memory goes back to the system, so the decode's own pages count), VmRSS is read,
the peak is reset (``5`` into /proc/self/clear_refs), the decode runs (its result kept), and VmHWM is read.
The larger table is ``benchmarks/decode_memory.py``'s (BENCHMARKS.md, "Decode memory")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtc.quant import DROP, FIXED_TYPES, TYPE_NAMES, dequantize, dequantize_numpy, quantize

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/proc/self/clear_refs").exists(), reason="reads /proc (Linux)"
)

MIB = 1 << 20
FACTOR, SLACK = 1.5, 64 * MIB
MODES = (
    "identity",
    "plan",
    "tiers",
    "ladder",
    "token-map",
    "sliding",
    "sliding-ladder",
    "layers",
    "layers-token-map",
    "layers-sliding-ladder",
)

SCRIPT = r"""
import ctypes, dataclasses, gc, json, re, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from kvtc import KVLayout, KVSlice
from kvtc.calibration import Recipe, fit_calibration
from kvtc.calibration.token_map import LAGS, TokenMap, probe_ids
from kvtc.codec import Codec, budget, container
from kvtc.rope import RopeKind, RopeSpec

L, H, D, B, MIB = 8, 1, 64, 2, 1 << 20
libc = ctypes.CDLL("libc.so.6")
gen = torch.Generator().manual_seed(0)


def status(key):
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024


class Source:
    def __init__(self, p, seed):
        g = torch.Generator().manual_seed(seed)
        self.q, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
        self.sd = torch.logspace(1, -2, p)
        self.mu = torch.randn(p, generator=g)

    def rows(self, n):
        return self.mu + (torch.randn(n, self.q.shape[0], generator=gen) * self.sd) @ self.q.T


def calibration(layout):
    p = layout.num_features
    ks, vs = Source(p, 1), Source(p, 2)
    inv = tuple(float(torch.tensor(10000 ** (-2 * i / D), dtype=torch.float32)) for i in range(D // 2))
    rope = RopeSpec(D, False, (RopeKind("full", "default", inv),), ("full",) * L).to_dict()
    cal = fit_calibration(layout, [(ks.rows(2048), vs.rows(2048)) for _ in range(2)],
                          Recipe(ratios=(8, 16, 32), dp_rows=256), rope=rope)
    q = torch.randn(L, H, 2, D, generator=gen)
    return dataclasses.replace(cal, queries=q, query_scales=torch.full((L,), D ** -0.5)), ks, vs


def kv_slice(layout, ks, vs, mib):
    T = mib * MIB // (2 * B * layout.num_features * 2)
    shape = (B, T, L, H, D)
    keys, values = ks.rows(B * T).view(shape).bfloat16(), vs.rows(B * T).view(shape).bfloat16()
    for i in range(L):
        keys[:, : T - layout.held(i, T), i] = 0
        values[:, : T - layout.held(i, T), i] = 0
    ids = torch.randint(0, 512, (B, T), generator=gen)
    return KVSlice(layout, keys, values, torch.arange(T).repeat(B, 1), "test", ids)


def token_map(cal):
    emb = torch.randn(512, 64, generator=gen)
    f = LAGS * 64
    w = {k: (torch.randn(f, cal.layout.num_features, generator=gen) * 0.05).half() for k in ("keys", "values")}
    return dataclasses.replace(cal, token_map=TokenMap.from_weights(LAGS, 512, torch.zeros(f), torch.ones(f), w, emb[probe_ids(512)])), emb


cases = {}
dense = KVLayout(tuple(range(L)), H, D, dtype="bfloat16")
sliding = KVLayout(tuple(range(L)), H, D, dtype="bfloat16", max_tokens=tuple(0 if i % 4 == 3 else 512 for i in range(L)))
cal, ks, vs = calibration(dense)
kv = kv_slice(dense, ks, vs, 96)
cases["identity"] = (Codec.identity(), Codec.identity().encode(kv), False)
kv = kv_slice(dense, ks, vs, 48)
for mode, tiers in (("plan", "none"), ("tiers", (8, 32)), ("ladder", "auto")):
    codec = Codec(cal, 16, tiers=tiers)
    cases[mode] = (codec, codec.encode(kv), False)
cases["layers"] = (cases["plan"][0], cases["plan"][1], True)
tcal, emb = token_map(cal)
codec = Codec(tcal, 16, tiers="none", embeddings=emb)
cases["token-map"] = (codec, codec.encode(kv), False)  # (the map's prediction is coded as part of the K/V)
cases["layers-token-map"] = (codec, cases["token-map"][1], True)
scal, ks, vs = calibration(sliding)
kv = kv_slice(sliding, ks, vs, 48)
for mode, tiers in (("sliding", "none"), ("sliding-ladder", "auto")):
    codec = Codec(scal, 16, tiers=tiers)
    cases[mode] = (codec, codec.encode(kv), False)
cases["layers-sliding-ladder"] = (cases["sliding-ladder"][0], cases["sliding-ladder"][1], True)
del kv, ks, vs
out = {}
for mode in sys.argv[1:]:
    codec, blob, layers = cases[mode]
    gc.collect()
    libc.malloc_trim(0)
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    got = list(codec.decode_layers(blob)) if layers else codec.decode(blob)
    peak = status("VmHWM")
    del got
    header, _ = container.read_header(blob)
    out[mode] = {"decoded": budget.decoded_output_bytes(header), "extra": peak - before}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, int]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, *MODES], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", MODES)
def test_a_decode_takes_at_most_one_and_a_half_times_its_decoded_bytes(measured, mode):
    got = measured[mode]
    bound = FACTOR * got["decoded"] + SLACK
    assert got["extra"] <= bound, (
        f"{mode}: a decode of {got['decoded'] / MIB:.0f} MiB took {got['extra'] / MIB:.0f} MiB more resident memory "
        f"({got['extra'] / got['decoded']:.2f}x), over {bound / MIB:.0f} MiB"
    )


@pytest.mark.parametrize("qtype", sorted(set(TYPE_NAMES) - {DROP}), ids=lambda t: TYPE_NAMES[t])
def test_the_numpy_dequantize_gives_the_same_bits_as_torch(qtype):
    """The CPU decode dequantizes with :func:`kvtc.quant.dequantize_numpy` (one thread, in place); it must give
    exactly :func:`kvtc.quant.dequantize`'s float32 bits for every type, or CPU and GPU decodes would drift apart."""
    g = torch.Generator().manual_seed(qtype)
    x = torch.randn(300, 7, 16, generator=g) * torch.logspace(-3, 2, 7).view(1, 7, 1)
    if qtype in FIXED_TYPES:
        steps = torch.logspace(-2, 0, 7)
        sym, _, _ = quantize(x, qtype, steps)
        want = dequantize(sym, None, None, qtype, steps)
        got = dequantize_numpy(sym.numpy(), None, None, qtype, steps.numpy())
    else:
        sym, shift, scale = quantize(x, qtype)
        want = dequantize(sym, shift, scale, qtype)
        out = np.full(sym.shape, np.nan, dtype=np.float32)
        got = dequantize_numpy(sym.numpy(), shift.numpy(), scale.numpy(), qtype, out=out)
        assert got is out
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.numpy().view(np.uint32))
