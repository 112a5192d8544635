"""GLM-5 (`glm_moe_dsa`) and DeepSeek-V3 in megatron-core: multi-head latent attention,
sigmoid expert routing with an expert bias, dense first layers.

`MLAShape.from_hf` reads the Hugging Face config; `build_mla_model` builds this rank's GPTModel
with megatron's local MLA layer spec (model.py's `ModelShape.from_hf` and `build_gpt_model`
hand these families over to it). Attention is mla_attention.py's core attention (causal, any
context-parallel size); GLM-5's DeepSeek Sparse Attention (top-k keys per query from frozen
indexers, shared across layers) is sparse_attention.py. Megatron's experimental DSA module
does not fit: it needs a CUDA Hadamard kernel, gives every layer its own indexer (GLM-5 shares
one top-k over several layers) and places the indexer's rope differently. One part of GLM-5 is
carried, not run:

- The MTP (next-token prediction) layer, stored by Hugging Face as layer `num_hidden_layers`.
  It is not trained (no MTP loss); its weights ride along unchanged so a weight sync carries
  a complete draft layer. Its `embed_tokens` and `shared_head.head` are left out: engines
  share the main model's embedding and head with the draft layer.

Carried tensors and the indexers' weights are frozen buffers (checkpointed with the model,
never given to the optimizer); weight_map_mla.py names them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from services.common.errors import ConfigError
from services.trainer.model.model import ModelShape, transformer_config

MLA_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v3")
_QK_NORM_EPS = 1e-6  # transformers builds q_a_layernorm/kv_a_layernorm with the default eps


@dataclass(frozen=True)
class MLAShape(ModelShape):
    """A ModelShape with multi-head latent attention, DSA and MTP facts."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    moe_layers: tuple[bool, ...] = ()
    moe_num_groups: int = 1
    moe_group_topk: int = 1
    moe_scaling_factor: float = 1.0
    index_topk: int | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_layers: tuple[int, ...] = ()
    num_mtp_layers: int = 0

    @property
    def is_mla(self) -> bool:
        return True

    @classmethod
    def from_hf(cls, hf_config: Any) -> MLAShape:
        """Read a GlmMoeDsaConfig or DeepseekV3Config."""
        c = hf_config
        model_type = c.model_type
        rope = dict(getattr(c, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope type {rope.get('rope_type')!r} of {model_type} is not"
                              " supported (only default RoPE)")
        if not getattr(c, "rope_interleave", True):
            raise ConfigError(f"{model_type} with rope_interleave=False is not supported")
        if not c.norm_topk_prob:
            raise ConfigError("sigmoid routing without norm_topk_prob is not supported")
        if getattr(c, "attention_bias", False):
            raise ConfigError(f"{model_type} with attention_bias is not supported")
        layer_types = getattr(c, "mlp_layer_types", None) or [
            "dense" if i < c.first_k_dense_replace else "sparse"
            for i in range(c.num_hidden_layers)
        ]
        n_group = int(getattr(c, "n_group", None) or 1)
        topk_group = int(getattr(c, "topk_group", None) or 1)
        if n_group > 1 and c.num_experts_per_tok // topk_group != 2:
            raise ConfigError("group-limited routing scores groups by their top 2 experts in"
                              " Hugging Face; megatron by top (experts per token / topk_group)")
        dsa = model_type == "glm_moe_dsa"
        indexer_types = list(getattr(c, "indexer_types", None) or []) if dsa else []
        num_mtp = getattr(c, "num_nextn_predict_layers", None)
        if num_mtp is None:
            num_mtp = getattr(c, "num_mtp_layers", 0)
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_attention_heads,
            head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
            ffn_hidden_size=c.intermediate_size,
            norm_eps=c.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(c.tie_word_embeddings),
            qkv_bias=False,
            qk_norm=True,
            num_experts=int(c.n_routed_experts),
            moe_topk=int(c.num_experts_per_tok),
            moe_ffn_hidden_size=int(c.moe_intermediate_size),
            moe_shared_ffn_hidden_size=int(c.moe_intermediate_size * c.n_shared_experts),
            moe_norm_topk_prob=True,
            model_type=model_type,
            q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            moe_layers=tuple(t == "sparse" for t in layer_types),
            moe_num_groups=n_group,
            moe_group_topk=topk_group,
            moe_scaling_factor=float(c.routed_scaling_factor),
            index_topk=int(c.index_topk) if dsa else None,
            index_n_heads=int(c.index_n_heads) if dsa else 0,
            index_head_dim=int(c.index_head_dim) if dsa else 0,
            indexer_layers=tuple(i for i, t in enumerate(indexer_types) if t == "full"),
            num_mtp_layers=int(num_mtp or 0),
        )


def mla_transformer_config(shape: MLAShape, *, tp: int, pp: int, cp: int, ep: int,
                           dtype: str, num_layers_per_stage: list[int] | None = None,
                           sequence_parallel: bool = False,
                           recompute: dict[str, Any] | None = None) -> Any:
    """Megatron's MLATransformerConfig: model.py's config plus the MLA and router fields."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = transformer_config(shape, tp=tp, pp=pp, cp=cp, ep=ep, dtype=dtype,
                              num_layers_per_stage=num_layers_per_stage,
                              sequence_parallel=sequence_parallel, recompute=recompute)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    groups = shape.moe_num_groups > 1
    fields.update(
        multi_latent_attention=True,
        q_lora_rank=shape.q_lora_rank,
        kv_lora_rank=shape.kv_lora_rank,
        qk_head_dim=shape.qk_nope_head_dim,
        qk_pos_emb_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        qk_layernorm=True,
        rope_type="rope",
        rotary_base=shape.rope_theta,
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
        moe_layer_freq=[int(m) for m in shape.moe_layers],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # the bias stays as loaded (no aux-free balancing)
        moe_router_topk_scaling_factor=shape.moe_scaling_factor,
        moe_router_num_groups=shape.moe_num_groups if groups else None,
        moe_router_group_topk=shape.moe_group_topk if groups else None,
        moe_router_pre_softmax=False,
        moe_shared_expert_gate=False,
    )
    return MLATransformerConfig(**fields)


def build_mla_model(shape: MLAShape, *, dtype: str = "float32",
                    num_layers_per_stage: list[int] | None = None,
                    sequence_parallel: bool = False,
                    recompute: dict[str, Any] | None = None) -> Any:
    """This rank's megatron GPTModel for an MLA `shape`, with the carried DSA/MTP buffers
    (`recompute`: megatron's recompute_* fields)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from services.trainer.attention.sparse_attention import attach_sharing, use_mla_attention
    from services.trainer.model import model as model_module
    from services.trainer.weights.weight_map_mla import carried_rules

    config = mla_transformer_config(
        shape, **model_module.parallel_sizes(), dtype=dtype,
        num_layers_per_stage=num_layers_per_stage, sequence_parallel=sequence_parallel,
        recompute=recompute,
    )  # fmt: skip
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization="RMSNorm")
    # The local final norm (apex's FusedLayerNorm, where installed, has no RMSNorm).
    dense = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                     normalization="RMSNorm")
    spec.layer_norm = dense.submodules.input_layernorm
    use_mla_attention(spec, shape)
    if config.tensor_model_parallel_size > 1:
        from services.trainer.parallel.sequence_parallel import use_tp_norms

        spec = use_tp_norms(spec, config)
    model_module._allow_moe_without_te()
    _allow_mla_without_te()
    model = model_module.stage_model(shape, config, spec)
    for module in model.modules():
        if isinstance(module, MLASelfAttention):
            for norm in (getattr(module, "q_layernorm", None), module.kv_layernorm):
                if norm is not None and hasattr(norm, "eps"):
                    norm.eps = _QK_NORM_EPS
    if config.tensor_model_parallel_size > 1:
        from services.trainer.parallel.sequence_parallel import use_latent_kv_projection

        use_latent_kv_projection(model)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    attach_carried(model, shape, carried_rules(shape), config.params_dtype, device)
    if shape.index_topk is not None:
        attach_sharing(model, shape)
    if cuda:
        model.cuda(torch.cuda.current_device())
    return model


def _allow_mla_without_te() -> None:
    # Without TransformerEngine, megatron's TE extension module still imports (its classes
    # become mocks) and MLA's `isinstance(linear_proj, TELinear)` fails.
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def attach_carried(model: Any, shape: MLAShape, rules: list[Any], dtype: torch.dtype,
                   device: torch.device | None) -> None:
    """Register a zero buffer for each carried tensor this rank holds (its pipeline stage's
    layers, the MTP layer on the last stage, its TP shard and its EP share of the experts)."""
    from megatron.core import parallel_state as ps

    from services.trainer.weights.convert import shard

    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    ep_rank = ps.get_expert_model_parallel_rank()
    ep_size = ps.get_expert_model_parallel_world_size()
    local_layers = {layer.layer_number - 1: j for j, layer in enumerate(model.decoder.layers)}
    per_rank = shape.num_experts // ep_size
    for rule in rules:
        parts = rule.mcore.split(".")
        if rule.layer is not None:
            if rule.layer not in local_layers:
                continue
            parts[2] = str(local_layers[rule.layer])
        elif not model.post_process:
            continue  # the MTP layer lives on the last stage
        if rule.expert is not None:
            if rule.expert // per_rank != ep_rank:
                continue
            j = parts.index("local_experts") + 1
            parts[j] = str(rule.expert % per_rank)
        owner = model
        for part in parts[:-1]:
            child = owner._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        local = shard(rule, torch.empty(rule.full_shape, device="meta"), tp_rank, tp_size)
        owner.register_buffer(parts[-1], torch.zeros(local.shape, dtype=dtype, device=device))
