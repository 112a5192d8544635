"""Small random Hugging Face causal LMs for converter and parity tests.

The weights are deliberately wide (a large init, random norm weights and biases): with
transformers' default small init attention is nearly uniform, and a wrong QKV layout can still
match the reference.
"""

from __future__ import annotations

from typing import Any

import torch

_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen2_moe": (
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "norm_topk_prob": True, "head_dim": 16},
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
        {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
         "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
         "v_head_dim": 16, "index_topk": 32, "index_n_heads": 2, "index_head_dim": 16,
         "index_topk_freq": 2, "index_skip_topk_offset": 1},
    ),
    "deepseek_v3": (
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        {"n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
         "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
         "v_head_dim": 16, "num_mtp_layers": 0},
    ),
}


def random_hf_model(
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 96,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    **overrides: Any,
) -> Any:
    """A random fp32 `arch` model (llama, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral,
    glm_moe_dsa, deepseek_v3) with eager attention; `overrides` go to the transformers config."""
    import transformers

    config_name, model_name, extra = _ARCHS[arch]
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=tie_word_embeddings,
        **{**extra, **overrides},
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # sigmoid routers' expert bias
                buffer.normal_(0.0, 0.3)
    return model


def reference_logprobs(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(token_t | tokens before t) [B, S] from a Hugging Face model, 0 at t = 0."""
    with torch.no_grad():
        logits = model(input_ids).logits.float()
    out = torch.zeros(input_ids.shape)
    out[:, 1:] = torch.log_softmax(logits[:, :-1], dim=-1).gather(
        -1, input_ids[:, 1:, None]
    )[..., 0]
    return out
