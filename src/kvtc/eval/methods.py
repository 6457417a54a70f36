"""KV compressors compared by ``kvtc eval``: kvtc itself and the peers a user would otherwise pick.

Every method compresses the tokens ``[start, stop)`` of a :class:`~kvtc.layout.KVSlice` (keys pre-RoPE,
``[batch, tokens, layers, heads, head_dim]``) and returns the slice with those tokens replaced by what
a decoder would give back, plus the bytes it really needs for them. Tokens outside ``[start, stop)``
(the attention sinks and the recent window) stay exact for every method, so all methods are compared on
the same compressed tokens.

Byte counts, for ``N`` compressed tokens and ``p`` features per token and kind (``2·N·p`` values):

* reference: 16-bit KV, ``2·N·p·2`` bytes (the model may compute in float32; ratios are against bf16);
* kvtc: the codec's bytes for the middle tokens from :meth:`Codec.inspect` (header, positions, shifts and
  scales, coded planes: everything but the raw sinks and window);
* FP8 E4M3: ``2·N·p`` bytes plus one float32 scale per layer and kind;
* KIVI b-bit: keys per channel over groups of 32 tokens, values per token over groups of 32 channels,
  ``b`` bits per value plus a 16-bit scale and a 16-bit zero per group (a last partial group counts whole);
* quanto / HQQ b-bit (transformers' ``QuantizedCache`` backends, their default axis 0 and group 64):
  ``b`` bits per value plus a 16-bit scale and zero per group of 64;
* token eviction (StreamingLLM: sinks + recent): the kept tokens in 16 bits; evicted tokens cost nothing
  and are masked out of attention.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..calibration import Calibration
from ..codec import Codec
from ..layout import DTYPES, KVSlice
from ..progress import StageTimer
from ..quant import FP8_MAX, INT2, INT4, dequantize, quantize
from ..rope import RopeSpec

#: bytes of one value in the reference (16-bit) cache
REFERENCE_BYTES = 2
#: KIVI's group size along tokens (keys) and channels (values)
KIVI_GROUP = 32
#: transformers' QuantizedCache defaults
PEER_GROUP = 64
PEER_AXIS = 0


@dataclass
class Result:
    """What a method gives back for tokens ``[start, stop)``.

    ``kv``: the slice with those tokens lossy; ``keep``: bool ``[batch, tokens]`` attention mask of the
    tokens still present (``None``: all); ``bytes``: bytes stored for them; ``bytes_raw``: bytes before
    entropy coding (kvtc only).
    """

    kv: KVSlice
    bytes: float
    keep: torch.Tensor | None = None
    bytes_raw: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Method:
    """A KV compressor. ``name`` is its curve in the plot, ``label`` its row in the table."""

    name: str = ""
    label: str = ""
    #: works on post-RoPE keys (what an engine's cache holds) rather than pre-RoPE ones
    post_rope: bool = True
    #: only meaningful in the storage round trip and retrieval protocols
    evicts: bool = False

    def compress(self, kv: KVSlice, start: int, stop: int, rope: RopeSpec) -> Result:
        keys = kv.keys
        if self.post_rope:
            keys = rope.apply(keys, kv.positions, kv.layout.layers)
        new_k = keys.clone()
        new_v = kv.values.clone()
        nbytes = 0.0
        # each set of layers holding the same tokens compresses the tokens of [start, stop) it holds
        for a, idx in coded_ranges(kv, start, stop):
            if idx is None:
                k2, v2, nb = self.roundtrip(keys[:, a:stop].clone(), kv.values[:, a:stop].clone())
                new_k[:, a:stop] = k2.to(keys.dtype)
                new_v[:, a:stop] = v2.to(kv.values.dtype)
            else:
                k2, v2, nb = self.roundtrip(keys[:, a:stop, idx], kv.values[:, a:stop, idx])
                new_k[:, a:stop, idx] = k2.to(keys.dtype)
                new_v[:, a:stop, idx] = v2.to(kv.values.dtype)
            nbytes += nb
        if self.post_rope:
            new_k = rope.invert(new_k, kv.positions, kv.layout.layers)
        return Result(KVSlice(kv.layout, new_k, new_v, kv.positions, kv.model_id), nbytes)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Lossy ``(keys, values, bytes)`` of ``[batch, n, layers, heads, head_dim]`` tensors."""
        raise NotImplementedError


def coded_ranges(kv: KVSlice, start: int, stop: int) -> list[tuple[int, torch.Tensor | None]]:
    """Per set of layers holding the same tokens (:attr:`~kvtc.layout.KVLayout.spans`): the first token of
    ``[start, stop)`` they hold and their layer positions (``None``: every layer)."""
    lay, T = kv.layout, kv.num_tokens
    out: list[tuple[int, torch.Tensor | None]] = []
    for sp in lay.spans:
        a = max(start, T - sp.held(T))
        if a < stop:
            every = len(sp.indices) == len(lay.layers)
            out.append((a, None if every else torch.tensor(sp.indices, device=kv.keys.device)))
    return out


def reference_bytes(kv: KVSlice, start: int, stop: int) -> float:
    """Bytes in 16 bits of the K and V that the layers hold among tokens ``[start, stop)`` (a sliding-window
    layer holds only its newest tokens)."""
    lay, T = kv.layout, kv.num_tokens
    per_layer = len(lay.heads) * lay.head_dim
    tokens = sum(max(stop - max(start, T - sp.held(T)), 0) * len(sp.indices) for sp in lay.spans)
    return 2.0 * kv.batch * tokens * per_layer * REFERENCE_BYTES


class KVTC(Method):
    """kvtc at one target ratio of a calibration (keys coded pre-RoPE, as the codec does).

    ``dtype``: storage dtype the slice is cast to before encoding, as ``compress_cache`` does (``None``: the
    slice's own); ``model_id``: the name written into the blob (``None``: the slice's). ``store``: what the blob
    goes through between encoding and decoding, ``blob -> blob`` (e.g. writing a file and reading it back;
    ``None``: memory). ``timer`` holds the seconds spent encoding and decoding, summed over calls. ``embeddings``:
    the model's input embeddings, for a calibration with a token map (the slices then carry their token ids).
    """

    post_rope = False

    def __init__(
        self,
        calibration: Calibration,
        ratio: float,
        name: str = "kvtc",
        label: str | None = None,
        *,
        dtype: str | None = None,
        model_id: str | None = None,
        store: Callable[[bytes], bytes] | None = None,
        tiers: Any = "auto",
        embeddings: torch.Tensor | None = None,
    ):
        self.calibration, self.ratio, self.tiers = calibration, ratio, tiers
        self.embeddings = embeddings
        self.name = name
        self.label = label or f"{name} {ratio:g}x"
        self.dtype, self.model_id, self.store = dtype, model_id, store
        self.timer = StageTimer()

    def _stored(self, kv: KVSlice) -> KVSlice:
        dtype = self.dtype or kv.layout.dtype
        model_id = kv.model_id if self.model_id is None else self.model_id
        if dtype == kv.layout.dtype and model_id == kv.model_id:
            return kv
        return KVSlice(
            dataclasses.replace(kv.layout, dtype=dtype),
            kv.keys.to(DTYPES[dtype]),
            kv.values.to(DTYPES[dtype]),
            kv.positions,
            model_id,
            kv.token_ids,
        )

    def compress(self, kv: KVSlice, start: int, stop: int, rope: RopeSpec) -> Result:
        codec = Codec(
            self.calibration, self.ratio, sinks=start, window=kv.num_tokens - stop, tiers=self.tiers,
            embeddings=self.embeddings,
        )  # fmt: skip
        stored = self._stored(kv)
        with self.timer("encode"):
            blob = codec.encode(stored)
        if self.store is not None:
            blob = self.store(blob)
        with self.timer("decode"):
            out = codec.decode(blob)
        facts = Codec.inspect(blob)
        # every byte of the blob but the raw sinks and window; before entropy coding, the same ratio to the
        # middle tokens' bytes as inspect reports (it measures against the stored dtype, the reference is 16-bit)
        coded = facts["coded_bytes"]
        before = facts["codec_ratio_before_entropy"]
        raw = facts["middle_bytes"] / before if before else 0.0
        keys = out.keys.to(kv.keys)
        values = out.values.to(kv.values)
        return Result(
            KVSlice(kv.layout, keys, values, kv.positions, kv.model_id, kv.token_ids),
            coded,
            bytes_raw=raw,
            info={"blob_bytes": facts["bytes"], "header_bytes": facts["header_bytes"]},
        )


class FP8(Method):
    """FP8 E4M3 with one scale per layer and kind (vLLM's ``--kv-cache-dtype fp8``)."""

    name = label = "fp8-e4m3"

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        def rt(x: torch.Tensor) -> torch.Tensor:
            amax = x.abs().amax(dim=(0, 1, 3, 4), keepdim=True).clamp(min=1e-12)
            scale = amax / FP8_MAX
            return (x / scale).to(torch.float8_e4m3fn).float() * scale

        layers = k.shape[2]
        return rt(k), rt(v), float(k.numel() + v.numel() + 2 * layers * 4)


def _minmax_groups(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """Asymmetric min/max quantization of ``x [groups, size]`` (fp16 shift and scale) -> (lossy, groups)."""
    qtype = {2: INT2, 4: INT4}[bits]
    sym, shift, scale = quantize(x[None], qtype)
    return dequantize(sym, shift, scale, qtype)[0], x.shape[0]


class KIVI(Method):
    """KIVI (Liu et al., 2024): keys per channel over ``group`` tokens, values per token over ``group`` channels."""

    def __init__(self, bits: int, group: int = KIVI_GROUP):
        self.bits, self.group = bits, group
        self.name = "kivi"
        self.label = f"KIVI {bits}-bit"

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        g = self.group
        B, n, L, H, D = k.shape
        groups = 0
        # keys: channels are (layer, head, dim); each channel is cut along tokens into groups of g
        kc = k.float().permute(0, 2, 3, 4, 1).reshape(-1, n)  # [channels, tokens]
        out_k = torch.empty_like(kc)
        for a in range(0, n, g):
            b = min(a + g, n)
            out_k[:, a:b], c = _minmax_groups(kc[:, a:b], self.bits)
            groups += c
        out_k = out_k.reshape(B, L, H, D, n).permute(0, 4, 1, 2, 3)
        # values: each token's head vector is cut along channels into groups of g
        vt = v.float().reshape(-1, D)
        out_v = torch.empty_like(vt)
        for a in range(0, D, g):
            b = min(a + g, D)
            out_v[:, a:b], c = _minmax_groups(vt[:, a:b], self.bits)
            groups += c
        out_v = out_v.reshape(v.shape)
        nbytes = (k.numel() + v.numel()) * self.bits / 8 + groups * 4
        return out_k, out_v, float(nbytes)


def peer_available(backend: str) -> str | None:
    """``None`` when transformers' ``QuantizedCache`` backend can run here, else why not."""
    package = {"quanto": "optimum.quanto", "hqq": "hqq"}[backend]
    try:
        if importlib.util.find_spec(package.split(".")[0]) is None or importlib.util.find_spec(package) is None:
            raise ImportError(f"{package} is not installed")
        from transformers import cache_utils

        layer_cls = {"quanto": cache_utils.QuantoQuantizedLayer, "hqq": cache_utils.HQQQuantizedLayer}[backend]
        layer = layer_cls(nbits=2)
        x = torch.randn(1, 1, 64, 8)
        layer.keys, layer.values = x, x
        layer._dequantize(layer._quantize(x, axis=PEER_AXIS))
    except Exception as e:  # any failure to import or run the peer library is a reason to skip it
        pip = {"quanto": "optimum-quanto", "hqq": "hqq termcolor"}[backend]
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (pip install --no-deps {pip})"
    return None


class Peer(Method):
    """transformers' ``QuantizedCache`` backend (``quanto`` or ``hqq``): its own layer's quantize/dequantize."""

    def __init__(self, backend: str, bits: int, group: int = PEER_GROUP, axis: int = PEER_AXIS):
        from transformers import cache_utils

        cls = {"quanto": cache_utils.QuantoQuantizedLayer, "hqq": cache_utils.HQQQuantizedLayer}[backend]
        self.layer = cls(nbits=bits, axis_key=axis, axis_value=axis, q_group_size=group)
        self.backend, self.bits, self.group, self.axis = backend, bits, group, axis
        self.name = backend
        self.label = f"{'quanto' if backend == 'quanto' else 'HQQ'} {bits}-bit (transformers)"

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        def rt(x: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(x)
            for li in range(x.shape[2]):
                t = x[:, :, li].transpose(1, 2).contiguous()  # the cache's [batch, heads, tokens, head_dim]
                self.layer.keys, self.layer.values = t, t
                out[:, :, li] = self.layer._dequantize(self.layer._quantize(t, axis=self.axis)).transpose(1, 2)
            return out

        n_values = k.numel() + v.numel()
        return rt(k), rt(v), n_values * self.bits / 8 + math.ceil(n_values / self.group) * 4


class Eviction(Method):
    """StreamingLLM-style eviction (Xiao et al., 2024): keep the sinks and the most recent tokens; of the
    compressed span, only its newest ``1/ratio`` survives, so the bytes match a ``ratio`` codec."""

    evicts = True

    def __init__(self, ratio: float):
        self.ratio = ratio
        self.name = "streamingllm"
        self.label = f"StreamingLLM {ratio:g}x"

    def compress(self, kv: KVSlice, start: int, stop: int, rope: RopeSpec) -> Result:
        n = stop - start
        kept = int(n // self.ratio)
        keep = torch.ones(kv.batch, kv.num_tokens, dtype=torch.bool, device=kv.keys.device)
        keep[:, start : stop - kept] = False
        return Result(kv, reference_bytes(kv, stop - kept, stop), keep=keep)
