"""The codecs of stored chunks, and the startup check that the calibration fits the served model."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ...calibration import Calibration
from ...codec import Codec
from ...errors import CalibrationError, CalibrationMismatch, ConfigError
from ...layout import KVLayout
from ...rope import RopeSpec
from ...textsafe import message
from .config import WHERE, ConnectorConfig

logger = logging.getLogger("kvtc.vllm")


#: token-adaptive rule of the connector's saves: recipe r13's two tiers (container version 3), not the rate ladder,
#: whose CPU encode costs 3-4x more: the saving process encodes on CPU time left idle and vLLM gives a worker's
#: shutdown only a few seconds to drain it (with the ladder, a cluster test lost a chunk of its prefix that way)
CONNECTOR_TIERS = "two"


class Codecs:
    """The codecs for stored chunks: the first chunk of a sequence keeps its sinks, later chunks code every token.

    Build it with :meth:`for_model`, which loads the calibration and refuses, before anything is served, a
    calibration that is unreadable, has no bit plan for the ratio, or was made for another model.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        calibration: Calibration | None,
        rope: RopeSpec | None,
        model: str = "the served model",
        checkpoint: str | None = None,
    ) -> None:
        if config.codec == "kvtc" and (calibration is None or rope is None):
            raise ConfigError(
                "codec='kvtc' needs a calibration and the model's RoPE spec; build the codecs with Codecs.for_model"
            )
        self.config = config
        self.calibration = calibration
        self.rope = rope
        self.model = model
        #: the served model's path or hub id: where a token-map calibration's input embeddings are read from
        self.checkpoint = checkpoint
        self._embeddings: torch.Tensor | None = None
        self._by_layout: dict[tuple[KVLayout, bool], Codec] = {}
        self._checked: dict[tuple, Calibration] = {}  # the checked calibration per model shape and heads
        self._warned = False  # the first chunk's sinks do not fit its budget (warned once)

    @classmethod
    def for_model(
        cls, config: ConnectorConfig, hf_config: Any, model: str = "the served model", checkpoint: str | None = None
    ) -> Codecs:
        """The codecs of ``config`` for the model that ``hf_config`` (its transformers config) describes.

        For the kvtc codec: loads the calibration, checks that it holds a bit plan for ``ratio`` and that it was
        made for this model (:meth:`Calibration.check_model`, the check every integration shares). ``model``
        names the served model in error messages.
        """
        if config.codec == "identity":
            if config.calibration is not None:
                logger.warning(
                    "KVTCConnector: codec='identity' stores raw KV; calibration=%r is not used", config.calibration
                )
            return cls(config, None, None, model)
        from ..hf import describe_model

        calibration = load_calibration(config)
        layout, rope = describe_model(hf_config)  # the model's KV layers, heads, head_dim and RoPE
        codecs = cls(config, calibration, rope, model, checkpoint)
        codecs.check(layout)
        return codecs

    @property
    def calibration_hash(self) -> str:
        return self.calibration.hash if self.calibration is not None else "none"

    def check(self, layout: KVLayout) -> None:
        """Build the codecs of ``layout`` (the model's, or the one this rank registered) now, refusing a
        calibration that does not fit it."""
        for first_chunk in (True, False):
            self.codec(layout, first_chunk, ready=False)
        if self.calibration is not None and self.calibration.token_map is not None:
            self._embedding_source()  # found, of the map's shape (read when a chunk is first coded)

    def _calibration_for(self, layout: KVLayout) -> Calibration:
        calib = self.calibration
        assert calib is not None and self.rope is not None
        key = (layout.model_shape, layout.heads)
        if key in self._checked:
            return self._checked[key]
        try:
            if layout.heads == calib.layout.heads:
                calib.check_model(layout, self.rope, model=self.model)
            else:  # tensor parallelism: check against the whole model, then keep this rank's heads only
                calib.check_model(dataclasses.replace(layout, heads=()), self.rope, model=self.model)
                calib = calib.shard(layout.heads)
        except CalibrationMismatch as e:
            raise ConfigError(
                f"{WHERE}: calibration={self.config.calibration!r} does not fit {self.model}: {message(e)}"
            ) from e
        self._checked[key] = calib
        return calib

    def codec(self, layout: KVLayout, first_chunk: bool, ready: bool = True) -> Codec:
        """The codec of ``layout``'s first chunk or of a later one; ``ready``: with the model's input embeddings
        when the calibration carries a token map (read from the checkpoint once)."""
        key = (layout, first_chunk)
        if key not in self._by_layout:
            if self.calibration is None:
                self._by_layout[key] = Codec.identity()
            else:
                calib = self._calibration_for(layout)
                sinks = self.config.sinks if first_chunk else 0
                ratio = self.first_chunk_ratio(calib) if sinks else self.config.ratio
                self._by_layout[key] = Codec(calib, ratio=ratio, sinks=sinks, window=0, tiers=CONNECTOR_TIERS)
        codec = self._by_layout[key]
        if ready and codec.needs_token_ids and self._embeddings is None:
            path, name = self._embedding_source()
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                self._embeddings = f.get_tensor(name)
        if ready and codec.needs_token_ids:
            codec.use_embeddings(self._embeddings)
        return codec

    def _embedding_source(self) -> tuple[str, str]:
        """The safetensors file and tensor name of the served model's input embeddings, found by name and shape
        (``*embed_tokens.weight`` or another ``*embed*`` tensor of ``[vocab, E]``); a ConfigError otherwise."""
        from .embeddings import find_input_embeddings

        tm = self.calibration.token_map  # type: ignore[union-attr]
        try:
            return find_input_embeddings(self.checkpoint, (tm.vocab, tm.dim))
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{WHERE}: calibration={self.config.calibration!r} codes each token's K/V less a prediction from its "
                f"token ids and needs {self.model}'s input embeddings [{tm.vocab}, {tm.dim}]: {e}; serve the model "
                "from a local directory of safetensors, or calibrate with `kvtc calibrate --token-map off`"
            ) from None

    def first_chunk_ratio(self, calib: Calibration) -> float:
        """The ratio a sequence's first chunk is coded at. Its raw sinks count against the chunk's budget, as every
        stored byte does: the least compressing calibrated ratio ``r >= ratio`` with ``sinks + (chunk - sinks) / r
        <= chunk / ratio`` (the calibration's plans store about their target). The configured ratio, with a
        warning, where no calibrated ratio fits (the first chunk then stores more than 1/ratio)."""
        chunk, sinks, ratio = self.config.chunk_tokens, self.config.sinks, self.config.ratio
        fits = [r for r in calib.ratios if r >= ratio and sinks + (chunk - sinks) / r <= chunk / ratio]
        if fits:
            return min(fits)
        if not self._warned:
            self._warned = True
            logger.warning(
                "KVTCConnector: %d raw sinks do not fit a %d-token chunk at 1/%g of its bytes with any calibrated "
                "ratio (%s); a sequence's first chunk stores more than 1/%g. Raise chunk_tokens, lower sinks, or "
                "calibrate a higher ratio",
                sinks,
                chunk,
                ratio,
                ", ".join(f"{r:g}" for r in calib.ratios),
                ratio,
            )
        return ratio

    @property
    def post_rope(self) -> bool:
        """Identity entries hold the cache's own post-RoPE keys (bit-exact, no rotation round trip); kvtc
        entries hold pre-RoPE keys, the basis the calibration was fitted on."""
        return self.config.codec == "identity"

    def dtype(self, cache_dtype: torch.dtype) -> str:
        """Element type of the stored slices: the cache's own float type for identity coding (fp8 caches are
        dequantized to float32), bf16 for the transform codec."""
        if self.config.codec != "identity":
            return "bfloat16"
        return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(cache_dtype, "float32")


def load_calibration(config: ConnectorConfig) -> Calibration:
    """The configured calibration, with a bit plan for the configured ratio; anything else is a ConfigError."""
    path = config.calibration
    try:
        calibration = Calibration.load(path)  # type: ignore[arg-type]
    except CalibrationError as e:
        raise ConfigError(f"{WHERE}: calibration={path!r} cannot be used: {message(e)}") from e
    try:
        calibration.plans_for(config.ratio)
    except CalibrationError:
        have = ", ".join(f"{r:g}" for r in calibration.ratios) or "none"
        raise ConfigError(
            f"{WHERE}: ratio={config.ratio:g} has no bit plan in calibration {path!r} (it has plans for {have}); "
            f"set ratio to one of those, or recalibrate with `kvtc calibrate --ratios ... {config.ratio:g}`"
        ) from None
    return calibration
