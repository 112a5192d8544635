"""The map between Hugging Face checkpoint tensors and megatron-core's (local spec) tensors.

Each `TensorRule` names one megatron tensor of the full (unsharded) model, the Hugging Face
tensors it is made of, how they fuse (QKV grouped by query group, fc1 as [gate; up]) and how
tensor parallelism splits it. convert.py applies the rules in both directions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from services.trainer.model.model import ModelShape

# replicate: norms, router; column: split dim 0; row: split dim 1; vocab: split rows;
# qkv: grouped by query group, split by whole groups; fc1: [gate; up], each split separately.
Kind = Literal["replicate", "column", "row", "vocab", "qkv", "fc1"]


@dataclass(frozen=True)
class TensorRule:
    """One full megatron tensor and the Hugging Face tensors it is fused from."""

    mcore: str
    hf: tuple[str, ...]
    kind: Kind
    full_shape: tuple[int, ...]
    layer: int | None = None
    expert: int | None = None


def fuse_qkv(shape: ModelShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's fused QKV: for each query group, its query heads, then its key and value head."""
    groups, hd = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups
    tail = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(groups, per_group * hd, *tail),
            k.reshape(groups, hd, *tail),
            v.reshape(groups, hd, *tail),
        ],
        dim=1,
    )
    return fused.reshape(-1, *tail)


def split_qkv(shape: ModelShape, fused: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `fuse_qkv`: the Hugging Face q, k and v tensors."""
    groups, hd = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups
    tail = fused.shape[1:]
    q, k, v = fused.reshape(groups, (per_group + 2) * hd, *tail).split(
        [per_group * hd, hd, hd], dim=1
    )
    return [t.reshape(-1, *tail).contiguous() for t in (q, k, v)]


def fuse(rule: TensorRule, shape: ModelShape, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor of `rule` from its Hugging Face parts."""
    if rule.kind == "qkv":
        return fuse_qkv(shape, *parts)
    if rule.kind == "fc1":
        return torch.cat(parts, dim=0)
    return parts[0]


def unfuse(rule: TensorRule, shape: ModelShape, full: torch.Tensor) -> list[torch.Tensor]:
    """The Hugging Face tensors of `rule` from its full megatron tensor."""
    if rule.kind == "qkv":
        return split_qkv(shape, full)
    if rule.kind == "fc1":
        return [t.contiguous() for t in full.chunk(2, dim=0)]
    return [full]


def _mlp_names(shape: ModelShape, prefix: str) -> tuple[str, str, str]:
    """Hugging Face gate, up and down projection names of an MLP at `prefix`."""
    if shape.model_type == "mixtral" and ".experts." in prefix:
        return f"{prefix}.w1.weight", f"{prefix}.w3.weight", f"{prefix}.w2.weight"
    return f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight", f"{prefix}.down_proj.weight"


def _mlp_rules(
    shape: ModelShape, mcore: str, hf_prefix: str, ffn: int, layer: int, expert: int | None
) -> list[TensorRule]:
    gate, up, down = _mlp_names(shape, hf_prefix)
    h = shape.hidden_size
    return [
        TensorRule(f"{mcore}.linear_fc1.weight", (gate, up), "fc1", (2 * ffn, h), layer, expert),
        TensorRule(f"{mcore}.linear_fc2.weight", (down,), "row", (h, ffn), layer, expert),
    ]


def _layer_rules(shape: ModelShape, i: int) -> list[TensorRule]:
    h, hd = shape.hidden_size, shape.head_dim
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * hd
    m, p = f"decoder.layers.{i}", f"model.layers.{i}"
    att = f"{p}.self_attn"
    # In the order transformers keeps a layer's tensors (attention, MLP, then the two norms),
    # so a sender's staged bucket lines up with an engine's parameters laid out in that order
    # (one copy a bucket there).
    norms = [
        TensorRule(f"{m}.input_layernorm.weight", (f"{p}.input_layernorm.weight",),
                   "replicate", (h,), i),
        TensorRule(f"{m}.pre_mlp_layernorm.weight", (f"{p}.post_attention_layernorm.weight",),
                   "replicate", (h,), i),
    ]
    rules = [
        TensorRule(f"{m}.self_attention.linear_qkv.weight",
                   (f"{att}.q_proj.weight", f"{att}.k_proj.weight", f"{att}.v_proj.weight"),
                   "qkv", (qkv_rows, h), i),
    ]
    if shape.qkv_bias:
        rules.append(TensorRule(
            f"{m}.self_attention.linear_qkv.bias",
            (f"{att}.q_proj.bias", f"{att}.k_proj.bias", f"{att}.v_proj.bias"),
            "qkv", (qkv_rows,), i))
    rules.append(TensorRule(f"{m}.self_attention.linear_proj.weight", (f"{att}.o_proj.weight",),
                            "row", (h, shape.num_heads * hd), i))
    if shape.qk_norm:
        rules += [
            TensorRule(f"{m}.self_attention.q_layernorm.weight", (f"{att}.q_norm.weight",),
                       "replicate", (hd,), i),
            TensorRule(f"{m}.self_attention.k_layernorm.weight", (f"{att}.k_norm.weight",),
                       "replicate", (hd,), i),
        ]
    if not shape.is_moe:
        return rules + _mlp_rules(shape, f"{m}.mlp", f"{p}.mlp", shape.ffn_hidden_size, i,
                                  None) + norms
    moe = f"{p}.block_sparse_moe" if shape.model_type == "mixtral" else f"{p}.mlp"
    rules.append(TensorRule(f"{m}.mlp.router.weight", (f"{moe}.gate.weight",), "replicate",
                            (shape.num_experts, h), i))
    for e in range(shape.num_experts):
        rules += _mlp_rules(shape, f"{m}.mlp.experts.local_experts.{e}", f"{moe}.experts.{e}",
                            shape.moe_ffn_hidden_size, i, e)
    if shape.moe_shared_ffn_hidden_size:
        rules += _mlp_rules(shape, f"{m}.mlp.shared_experts", f"{moe}.shared_expert",
                            shape.moe_shared_ffn_hidden_size, i, None)
        rules.append(TensorRule(f"{m}.mlp.shared_experts.gate_weight",
                                (f"{moe}.shared_expert_gate.weight",), "replicate", (1, h), i))
    return rules + norms


def tensor_rules(shape: ModelShape) -> list[TensorRule]:
    """Every tensor of the full model, in Hugging Face checkpoint order."""
    if shape.is_mla:
        from services.trainer.weights import weight_map_mla

        return weight_map_mla.tensor_rules(shape)  # type: ignore[arg-type]
    v, h = shape.vocab_size, shape.hidden_size
    rules = [TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                        "vocab", (v, h))]
    for i in range(shape.num_layers):
        rules += _layer_rules(shape, i)
    rules.append(TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",),
                            "replicate", (h,)))
    if not shape.tie_word_embeddings:
        rules.append(TensorRule("output_layer.weight", ("lm_head.weight",), "vocab", (v, h)))
    return rules


def checkpoint_state(
    shape: ModelShape, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict with checkpoint names: per-expert tensors where transformers
    keeps the experts fused in memory (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            for e in range(tensor.shape[0]):
                gate, up, _ = _mlp_names(shape, _checkpoint_prefix(shape, prefix, e))
                out[gate], out[up] = tensor[e].chunk(2, dim=0)
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(tensor.shape[0]):
                out[_mlp_names(shape, _checkpoint_prefix(shape, prefix, e))[2]] = tensor[e]
        else:
            out[name] = tensor
    if shape.model_type == "mixtral":
        out = {k.replace(".mlp.gate.", ".block_sparse_moe.gate."): t for k, t in out.items()}
    return out


def _checkpoint_prefix(shape: ModelShape, experts_prefix: str, e: int) -> str:
    if shape.model_type == "mixtral":
        experts_prefix = experts_prefix.replace(".mlp.experts", ".block_sparse_moe.experts")
    return f"{experts_prefix}.{e}"
