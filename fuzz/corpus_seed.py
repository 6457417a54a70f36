"""Seed blobs for the container fuzzer: the checked-in fixture plus real blobs made with the fixture
calibration at other settings (identity codec, several batch and token counts, every entropy backend,
both packings, other slice dtypes, a second ratio), so mutations start from every section shape the
encoder produces.

``build_seeds()`` returns ``{name: blob}`` (deterministic: same bytes on every run of one kvtc version);
``python fuzz/corpus_seed.py DIR`` writes them to ``DIR/<name>.kvtc`` (an atheris / libFuzzer corpus).
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import torch

from kvtc import KVSlice
from kvtc.calibration import Calibration
from kvtc.codec import Codec
from kvtc.coding.entropy import BACKENDS

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


@lru_cache(maxsize=1)
def load_calibration() -> Calibration:
    return Calibration.load(FIXTURES / "calibration.safetensors")


def _slice(cal: Calibration, batch: int, tokens: int, dtype: torch.dtype, seed: int) -> KVSlice:
    lay = cal.layout
    if dtype != lay.torch_dtype:
        from dataclasses import replace

        from kvtc.layout import dtype_name

        lay = replace(lay, dtype=dtype_name(dtype))
    g = torch.Generator().manual_seed(seed)
    shape = (batch, tokens, len(lay.layers), len(lay.heads), lay.head_dim)
    keys = (torch.randn(shape, generator=g) + 0.5).to(dtype)
    values = (torch.randn(shape, generator=g) * 0.3).to(dtype)
    positions = torch.arange(tokens, dtype=torch.int64).repeat(batch, 1) + seed
    return KVSlice(lay, keys, values, positions, model_id="fixture")


#: (name, codec settings or None for identity, batch, tokens, dtype)
_SETTINGS = [
    ("kvtc_r8_zstd_b1_t40", dict(ratio=8, sinks=2, window=4), 1, 40, torch.bfloat16),
    ("kvtc_r4_zstd_b2_t24", dict(ratio=4, sinks=2, window=4), 2, 24, torch.bfloat16),
    ("kvtc_r8_zlib_b3_t17", dict(ratio=8, sinks=1, window=3, backend="zlib"), 3, 17, torch.bfloat16),
    ("kvtc_r8_raw_b1_t64", dict(ratio=8, sinks=4, window=8, backend="raw"), 1, 64, torch.bfloat16),
    ("kvtc_r8_bytes_b2_t33", dict(ratio=8, sinks=2, window=4, packing="bytes"), 2, 33, torch.bfloat16),
    ("kvtc_r4_raw_bytes_b1_t9", dict(ratio=4, sinks=0, window=0, backend="raw", packing="bytes"), 1, 9, torch.bfloat16),
    ("kvtc_r8_fp16_b1_t20", dict(ratio=8, sinks=2, window=2), 1, 20, torch.float16),
    ("kvtc_r8_fp32_zlib_b2_t12", dict(ratio=8, sinks=1, window=1, backend="zlib"), 2, 12, torch.float32),
    ("kvtc_r8_all_protected_b2_t5", dict(ratio=8, sinks=4, window=128), 2, 5, torch.bfloat16),
    ("kvtc_r8_t1", dict(ratio=8, sinks=0, window=0), 1, 1, torch.bfloat16),
    ("kvtc_r8_t0", dict(ratio=8), 1, 0, torch.bfloat16),
    ("kvtc_r8_b0", dict(ratio=8), 0, 6, torch.bfloat16),
    ("identity_raw_b1_t8", None, 1, 8, torch.bfloat16),
    ("identity_zlib_b2_t16", dict(backend="zlib"), 2, 16, torch.bfloat16),
    ("identity_zstd_b3_t5", dict(backend="zstd"), 3, 5, torch.float16),
    ("identity_bytes_fp32_b1_t3", dict(packing="bytes"), 1, 3, torch.float32),
    ("identity_t0", None, 1, 0, torch.bfloat16),
]


@lru_cache(maxsize=1)
def _seeds() -> tuple[tuple[str, bytes], ...]:
    cal = load_calibration()
    out = [("fixture_sample", (FIXTURES / "sample.kvtc").read_bytes())]
    settings = list(_SETTINGS)
    for extra in sorted(set(BACKENDS) - {"raw", "zlib", "zstd"}):  # e.g. a GPU backend's CPU twin
        settings.append(
            (f"kvtc_r8_{extra}_b2_t30", dict(ratio=8, sinks=2, window=4, backend=extra), 2, 30, torch.bfloat16)
        )
        settings.append((f"identity_{extra}_b1_t12", dict(backend=extra), 1, 12, torch.float16))
    for i, (name, kw, batch, tokens, dtype) in enumerate(settings):
        kv = _slice(cal, batch, tokens, dtype, seed=100 + i)
        if name.startswith("identity"):
            codec = Codec.identity(**(kw or {}))
        else:
            codec = Codec(cal, **kw)
        out.append((name, codec.encode(kv)))
    return tuple(out)


def build_seeds() -> dict[str, bytes]:
    """Every seed blob by name; each one decodes cleanly with the fixture calibration."""
    return dict(_seeds())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python fuzz/corpus_seed.py CORPUS_DIR", file=sys.stderr)
        return 2
    d = Path(argv[1])
    d.mkdir(parents=True, exist_ok=True)
    for name, blob in build_seeds().items():
        (d / f"{name}.kvtc").write_bytes(blob)
    print(f"wrote {len(build_seeds())} seeds to {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
