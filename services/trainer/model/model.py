"""Build a megatron-core GPTModel that computes what a Hugging Face Llama/Qwen2 model computes.

`ModelShape.from_hf` reads the architecture facts Riptide needs from a Hugging Face config
(dense Llama, Qwen2, Qwen3 with q/k norms, and the MoE variants Mixtral, Qwen2-MoE, Qwen3-MoE);
`transformer_config` maps them onto megatron's TransformerConfig and `build_gpt_model` builds
this rank's part of the model after `parallel.init_parallel`, with the layer spec of the chosen
attention backend (`attention_spec`): megatron's local spec with torch's fused kernels
(fused_attention.py, the default), the local spec as megatron ships it ("local", which
materialises [heads, S, S] scores), or TransformerEngine's spec where it is importable ("te").
Under context parallelism the local and fused backends use context_parallel.py's layout.
Activation recomputation is megatron's (`recompute`: granularity, method, number of layers).
The converters (convert.py) use the same ModelShape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.common.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    """The architecture of a Llama-family model, independent of its parallel layout."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_shared_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    model_type: str = "llama"
    rope_scaling_factor: float | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (model_mla.MLAShape)."""
        return False

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelShape:
        """Read a transformers config (LlamaConfig, Qwen2Config, MixtralConfig, ...)."""
        c = hf_config
        model_type = getattr(c, "model_type", "llama")
        if model_type in ("glm_moe_dsa", "deepseek_v3"):
            from services.trainer.model.model_mla import MLAShape

            return MLAShape.from_hf(c)
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
        rope_theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = float(rope["factor"])
            fixed = (rope.get("low_freq_factor"), rope.get("high_freq_factor"),
                     rope.get("original_max_position_embeddings"))
            if fixed != (1.0, 4.0, 8192):  # megatron's llama3 scaling hard-codes these
                raise ConfigError(f"llama3 rope scaling with (low_freq_factor, high_freq_factor,"
                                  f" original_max_position_embeddings) = {fixed} is not supported")
        elif rope_type not in ("default", None):
            raise ConfigError(f"rope type {rope_type!r} of {model_type} is not supported")
        num_experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", 0) or 0
        if getattr(c, "decoder_sparse_step", 1) != 1 or getattr(c, "mlp_only_layers", None):
            raise ConfigError("MoE models with dense layers in between are not supported")
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            ffn_hidden_size=c.intermediate_size,
            norm_eps=c.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(getattr(c, "attention_bias", 0)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            num_experts=int(num_experts),
            moe_topk=int(getattr(c, "num_experts_per_tok", 0) or 0),
            moe_ffn_hidden_size=int(getattr(c, "moe_intermediate_size", 0) or c.intermediate_size),
            moe_shared_ffn_hidden_size=int(getattr(c, "shared_expert_intermediate_size", 0) or 0),
            moe_norm_topk_prob=model_type == "mixtral" or bool(getattr(c, "norm_topk_prob", 0)),
            model_type=model_type,
            rope_scaling_factor=scaling,
        )


def transformer_config(
    shape: ModelShape,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    dtype: str = "float32",
    num_layers_per_stage: list[int] | None = None,
    sequence_parallel: bool = False,
    recompute: dict[str, Any] | None = None,
) -> Any:
    """Megatron's TransformerConfig for `shape` split over the given parallel sizes (the
    pipeline stages holding `num_layers_per_stage` layers each, or an even split; sequence
    parallelism where asked for and TP > 1; `recompute`: megatron's recompute_* fields)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from services.trainer.parallel.pipeline_layout import megatron_layout, split_layers

    if shape.num_kv_heads % tp:
        raise ConfigError(
            f"tensor_parallel={tp} must divide the {shape.num_kv_heads} key/value heads"
        )
    if shape.vocab_size % tp:
        raise ConfigError(f"tensor_parallel={tp} must divide the vocabulary ({shape.vocab_size})")
    stage_layout = megatron_layout(split_layers(shape.num_layers, pp, num_layers_per_stage))
    if shape.is_moe and shape.num_experts % ep:
        raise ConfigError(f"expert_parallel={ep} must divide the {shape.num_experts} experts")
    torch_dtype = _DTYPES[dtype]
    moe: dict[str, Any] = {}
    if shape.is_moe:
        moe = dict(
            num_moe_experts=shape.num_experts,
            moe_router_topk=shape.moe_topk,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=shape.moe_shared_ffn_hidden_size or None,
            moe_shared_expert_gate=shape.moe_shared_ffn_hidden_size > 0,
            # HF renormalises the top-k probabilities (norm_topk_prob) or keeps the full softmax.
            moe_router_pre_softmax=not shape.moe_norm_topk_prob,
            moe_router_load_balancing_type="none",
            # alltoall needs CUDA streams; allgather runs on gloo too.
            moe_token_dispatcher_type=(
                "alltoall" if ep > 1 and torch.cuda.is_available() else "allgather"
            ),
            moe_grouped_gemm=False,
            expert_tensor_parallel_size=1,
            moe_router_dtype="fp32",
        )
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=True,
        # megatron's fused SwiGLU is torch-jit code: it needs no TransformerEngine or apex.
        bias_activation_fusion=torch.cuda.is_available(),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_model_parallel_layout=stage_layout,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype is torch.bfloat16,
        fp16=torch_dtype is torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        **(recompute or {}),
        **moe,
    )


def _allow_moe_without_te() -> None:
    # megatron-core 0.16 reads moe_utils.te_general_gemm, defined only when TransformerEngine
    # imports; None selects its plain torch path.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


ATTENTION_BACKENDS = ("fused", "local", "te")


def attention_spec(shape: ModelShape, backend: str, cp: int) -> Any:
    """The GPT layer spec of an attention backend (see the module doc)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention backend {backend!r} is none of {ATTENTION_BACKENDS}")
    moe = {"num_experts": shape.num_experts or None, "moe_grouped_gemm": False,
           "qk_layernorm": shape.qk_norm}  # fmt: skip
    if backend == "te":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as err:
            raise ConfigError(
                "attention_backend = \"te\" needs transformer_engine, which does not import"
                f" here ({err}); use \"fused\""
            ) from err
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(**moe, normalization="RMSNorm")
    if backend == "local" and cp == 1:
        return spec
    from services.trainer.attention import fused_attention
    from services.trainer.attention.context_parallel import (
        ContextParallelAttention,
        with_core_attention,
    )

    if cp > 1:
        return with_core_attention(spec, ContextParallelAttention if backend == "local"
                                   else fused_attention.FusedContextParallelAttention)
    return with_core_attention(spec, fused_attention.FusedAttention)


def build_gpt_model(
    shape: ModelShape, *, dtype: str = "float32", num_layers_per_stage: list[int] | None = None,
    sequence_parallel: bool = False, attention: str = "fused",
    recompute: dict[str, Any] | None = None,
) -> Any:
    """This rank's megatron GPTModel for `shape`, in the layout `init_parallel` set up (and
    `num_layers_per_stage`, parallel.num_layers_per_stage), with the `attention` backend's
    layer spec and megatron's `recompute` settings."""
    if shape.is_mla:
        from services.trainer.model.model_mla import build_mla_model

        return build_mla_model(
            shape,  # type: ignore[arg-type]
            dtype=dtype, num_layers_per_stage=num_layers_per_stage,
            sequence_parallel=sequence_parallel, recompute=recompute,
        )
    from megatron.core import parallel_state as ps

    config = transformer_config(
        shape, **parallel_sizes(), dtype=dtype, num_layers_per_stage=num_layers_per_stage,
        sequence_parallel=sequence_parallel, recompute=recompute,
    )  # fmt: skip
    spec = attention_spec(shape, attention, ps.get_context_parallel_world_size())
    from services.trainer.attention import rope

    rope.install()  # RoPE tables once a forward, one fused rotation (THD: one gather)
    if config.tensor_model_parallel_size > 1 and attention != "te":
        from services.trainer.parallel.sequence_parallel import use_tp_norms

        spec = use_tp_norms(spec, config)
    if attention != "te":
        from services.trainer.model import swiglu

        spec = swiglu.with_swiglu(spec)  # a one-pass backward (dense MLPs; MoE keeps its own)
        if swiglu.uses_swiglu(spec):
            swiglu.use_swiglu(config)
    if shape.is_moe:
        _allow_moe_without_te()
    model = stage_model(
        shape, config, spec, rope_scaling=shape.rope_scaling_factor is not None,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
    )  # fmt: skip
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def parallel_sizes() -> dict[str, int]:
    """TP, PP, CP and EP sizes of the layout `init_parallel` set up (transformer_config's)."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
    }


def stage_model(shape: ModelShape, config: Any, spec: Any, **rope: Any) -> Any:
    """megatron's GPTModel for this rank's pipeline stage, with RoPE (`rope`: its scaling)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,  # type: ignore[arg-type]
        **rope,
    )


def load_hf_config(path: str) -> Any:
    """The transformers config of a Hugging Face model folder (ConfigError if there is none:
    a restart cannot fix that)."""
    from pathlib import Path

    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"trainer.model.hf_path: no Hugging Face model at {path} "
                          "(config.json missing)")
    return AutoConfig.from_pretrained(path)
