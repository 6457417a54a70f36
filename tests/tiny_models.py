"""Tiny random transformers models built from configs (no download), one per RoPE / layer-type variant.

Each builder returns a seeded float32 model in eval mode. :data:`TINY` describes what each one exercises and the
real indices of its KV-carrying layers, so tests can assert them independently of the code under test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    Cohere2Config,
    Exaone4Config,
    Gemma3TextConfig,
    GlmConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3NextConfig,
    SmolLM3Config,
    StableLmConfig,
)

VOCAB = 128
#: small dims shared by the dense models: 4 query heads, 2 KV heads of 16.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def llama() -> PreTrainedConfig:
    return LlamaConfig(**COMMON, num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1e5})


def llama3() -> PreTrainedConfig:
    return LlamaConfig(
        **COMMON,
        num_hidden_layers=2,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    )


def llama_dynamic() -> PreTrainedConfig:
    return LlamaConfig(
        **COMMON,
        num_hidden_layers=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )


def qwen2() -> PreTrainedConfig:
    return Qwen2Config(**COMMON, num_hidden_layers=2)  # q/k/v projections carry a bias


def qwen3() -> PreTrainedConfig:
    return Qwen3Config(**COMMON, num_hidden_layers=2)  # QK-norm before RoPE


def qwen3_yarn() -> PreTrainedConfig:
    return Qwen3Config(
        **COMMON,
        num_hidden_layers=2,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "rope_theta": 1e6,
        },
    )


def gemma3(sliding_window: int = 32) -> PreTrainedConfig:
    """MQA (1 KV head of 256), QK-norm, sliding layers (local theta 1e4), full layers (global theta 1e6, linear x8)."""
    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def gemma3_small_window() -> PreTrainedConfig:
    return gemma3(sliding_window=4)


def phi3_longrope() -> PreTrainedConfig:
    """Phi-3 style longrope (short / long factors, attention scaling) with partial rotary 0.75 (Phi-4-mini)."""
    cfg = dict(COMMON)
    cfg.pop("head_dim")  # Phi-3 derives it: 64 / 4 = 16
    return Phi3Config(
        **cfg,
        num_hidden_layers=2,
        partial_rotary_factor=0.75,
        max_position_embeddings=4096,
        original_max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(6)],
            "long_factor": [2.0 + 0.5 * i for i in range(6)],
        },
    )


def stablelm() -> PreTrainedConfig:
    """Partial rotary (first 25% of each head) split off in the attention layer before apply_rotary_pos_emb."""
    cfg = dict(COMMON)
    cfg.pop("head_dim")
    return StableLmConfig(**cfg, num_hidden_layers=2, partial_rotary_factor=0.25)


def glm() -> PreTrainedConfig:
    return GlmConfig(**COMMON, num_hidden_layers=2)  # interleaved pairs, partial rotary 0.5


def smollm3() -> PreTrainedConfig:
    return SmolLM3Config(**COMMON, num_hidden_layers=4, no_rope_layer_interval=2)  # layers 1 and 3 use no RoPE


def mistral_sliding() -> PreTrainedConfig:
    """Every layer a sliding-window layer (Mistral 7B v0.1)."""
    return MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=16)


def gpt_oss() -> PreTrainedConfig:
    """Sliding and full layers alternating, yarn RoPE, learned attention sinks, a mixture of experts."""
    layer_types = ["sliding_attention", "full_attention"] * 2
    return GptOssConfig(**COMMON, num_hidden_layers=4, sliding_window=16, layer_types=layer_types, num_local_experts=4)


def cohere2() -> PreTrainedConfig:
    """Sliding layers with (interleaved) RoPE, the full-attention layer without: a rule of its attention code."""
    layer_types = ["sliding_attention"] * 3 + ["full_attention"]
    return Cohere2Config(**COMMON, num_hidden_layers=4, sliding_window=16, layer_types=layer_types)


def exaone4() -> PreTrainedConfig:
    """EXAONE 4: QK-norm, sliding layers with RoPE, full-attention layers (1 and 3) without."""
    return Exaone4Config(**COMMON, num_hidden_layers=4, sliding_window=16, sliding_window_pattern=2)


def qwen3_next() -> PreTrainedConfig:
    """Hybrid: gated-delta-net linear attention on layers 0-2 and 4-6, full attention (partial rotary) on 3 and 7."""
    return Qwen3NextConfig(
        **COMMON,
        num_hidden_layers=8,
        full_attention_interval=4,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )


@dataclass(frozen=True)
class TinySpec:
    build_config: Callable[[], PreTrainedConfig]
    kv_layers: tuple[int, ...]
    #: positions the model's rotation may be compared at (dynamic rope is only exact below its limit).
    max_position: int = 131072
    #: the layers whose attention applies no RoPE
    nope_layers: tuple[int, ...] = ()


TINY: dict[str, TinySpec] = {
    "llama": TinySpec(llama, (0, 1)),
    "llama3": TinySpec(llama3, (0, 1)),
    "llama_dynamic": TinySpec(llama_dynamic, (0, 1), max_position=64),
    "qwen2": TinySpec(qwen2, (0, 1)),
    "qwen3": TinySpec(qwen3, (0, 1)),
    "qwen3_yarn": TinySpec(qwen3_yarn, (0, 1)),
    "gemma3": TinySpec(gemma3, (0, 1, 2, 3)),
    "phi3_longrope": TinySpec(phi3_longrope, (0, 1)),
    "stablelm": TinySpec(stablelm, (0, 1)),
    "glm": TinySpec(glm, (0, 1)),
    "smollm3": TinySpec(smollm3, (0, 1, 2, 3), nope_layers=(1, 3)),
    "mistral_sliding": TinySpec(mistral_sliding, (0, 1)),
    "gpt_oss": TinySpec(gpt_oss, (0, 1, 2, 3)),
    "cohere2": TinySpec(cohere2, (0, 1, 2, 3), nope_layers=(3,)),
    "exaone4": TinySpec(exaone4, (0, 1, 2, 3), nope_layers=(1, 3)),
    "qwen3_next": TinySpec(qwen3_next, (3, 7)),
}


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A seeded random model of variant ``name`` (a key of :data:`TINY`), eval mode."""
    config = TINY[name].build_config()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def pre_rope_key_hooks(model: PreTrainedModel, store: dict[int, torch.Tensor]) -> list:
    """Forward hooks recording each attention layer's keys just before RoPE as ``store[layer] = [batch, tokens,
    kv_heads, head_dim]``: the output of ``k_norm`` for QK-norm models, else of ``k_proj`` (or the key part of a
    fused ``qkv_proj``). Returns the handles; remove them after use."""
    cfg = model.config
    heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue

        def to_bthd(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 3:  # [batch, tokens, heads * head_dim]
                return t.view(t.shape[0], t.shape[1], heads, head_dim)
            if t.shape[1] == heads and t.shape[2] != heads:  # [batch, heads, tokens, head_dim]
                return t.transpose(1, 2)
            return t

        if hasattr(attn, "k_norm"):
            target, pick = attn.k_norm, to_bthd
        elif hasattr(attn, "k_proj"):
            target, pick = attn.k_proj, to_bthd
        else:  # fused projection: queries, then keys, then values
            q_width = cfg.num_attention_heads * head_dim

            def pick(t: torch.Tensor, q_width: int = q_width) -> torch.Tensor:
                return to_bthd(t[..., q_width : q_width + heads * head_dim])

            target = attn.qkv_proj

        def hook(_module, _inputs, output, i=i, pick=pick):
            store[i] = pick(output).detach().clone()

        handles.append(target.register_forward_hook(hook))
    return handles
