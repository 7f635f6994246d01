"""Tiny random-weight transformers MoE models for tests and the GPU check (no download).

Example::

    model = tiny_hf_model("qwen3_moe", seed=0)          # Qwen3MoeForCausalLM, eval mode, fp32
    ids = torch.randint(0, model.config.vocab_size, (4, 7))
    logits = model(input_ids=ids, use_cache=False).logits   # [4, 7, 128]

Weights are a deterministic function of ``seed`` and the parameter name (never of the rank or
of the global RNG): every rank of an EP group builds the same model. Linear and expert weights
are ``N(0, 1) / sqrt(fan_in)`` (the last dim), embeddings ``N(0, 1)``, 1-D parameters and
buffers other than norm weights ``N(0, 0.1^2)`` (router biases, DeepSeek-V3's
``e_score_correction_bias``), norm weights 1, so that routing is not degenerate.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn

__all__ = ["TINY_MODEL_TYPES", "tiny_hf_config", "tiny_hf_model"]

_COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=False)

#: model_type -> (config class, model class, config overrides); 4 routed experts (8 for
#: DeepSeek-V3: 2 groups of 4), top-2.
_TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
        max_position_embeddings=256)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
}
#: The model types :func:`tiny_hf_model` builds.
TINY_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_TINY))


def tiny_hf_config(model_type: str, **overrides: Any) -> Any:
    """The tiny config of ``model_type`` (hidden 32, 2 layers, 4 heads), fields overridden.

    Raises:
        KeyError: ``model_type`` is not one of :data:`TINY_MODEL_TYPES`.
    """
    import transformers

    config_cls, _, kwargs = _TINY[model_type]
    return getattr(transformers, config_cls)(**{**_COMMON, **kwargs, **overrides})


def _scale(name: str, t: torch.Tensor) -> float | None:
    if "norm" in name and name.endswith("weight"):
        return None  # stays 1
    if t.dim() <= 1:
        return 0.1
    if "embed_tokens" in name:
        return 1.0
    return t.shape[-1] ** -0.5


@torch.no_grad()
def tiny_hf_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", **overrides: Any) -> nn.Module:
    """A tiny ``*ForCausalLM`` of ``model_type`` with deterministic random weights, in eval mode.

    Args:
        model_type: one of :data:`TINY_MODEL_TYPES`.
        seed: weights are a function of ``seed`` and each tensor's name.
        dtype: parameter dtype.
        device: where the model lives.
        overrides: config fields to replace.

    GPT-OSS uses ``attn_implementation="eager"`` (transformers has no SDPA path for its
    attention sinks); the others use SDPA.
    """
    import transformers

    _, model_cls, _ = _TINY[model_type]
    config = tiny_hf_config(model_type, **overrides)
    config._attn_implementation = "eager" if model_type == "gpt_oss" else "sdpa"
    model = getattr(transformers, model_cls)(config)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    for name, t in tensors.items():
        scale = _scale(name, t)
        if scale is None:
            t.fill_(1.0)
            continue
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * scale)
    return model.to(device=device, dtype=dtype).eval()
