"""Tensor rules for the MLA families (GLM-5 `glm_moe_dsa`, DeepSeek-V3), as weight_map.py's
`TensorRule`s, so convert.py loads, shards and gathers them like any other model.

MLA needs no fusing: megatron's projections hold the Hugging Face tensors as they are
(q_a_proj -> linear_q_down_proj, q_b_proj -> linear_q_up_proj, kv_a_proj_with_mqa ->
linear_kv_down_proj, kv_b_proj -> linear_kv_up_proj); megatron de-interleaves the rotary
dimensions itself, as Hugging Face's `apply_rotary_pos_emb_interleave` does. Under TP the
down projections are column-parallel too (megatron gathers their outputs).

Carried tensors (model_mla.py): the DSA indexer of each "full" indexer layer, in its Hugging
Face layout and replicated over TP, and the MTP layer under megatron's MTP layer names
(`mtp_carried.layers.{k}.transformer_layer...`), sharded over TP and EP like a decoder layer.
"""

from __future__ import annotations

from services.trainer.model.model_mla import MLAShape
from services.trainer.weights.weight_map import TensorRule, _mlp_rules

# Not megatron's `mtp`: its pipeline schedules treat a module of that name as a live MTP block.
MTP_PREFIX = "mtp_carried"


def _attention_rules(shape: MLAShape, m: str, p: str, i: int | None) -> list[TensorRule]:
    h, n = shape.hidden_size, shape.num_heads
    att, sa = f"{p}.self_attn", f"{m}.self_attention"
    q_dim = n * (shape.qk_nope_head_dim + shape.qk_rope_head_dim)
    rules: list[TensorRule] = []
    if shape.q_lora_rank:
        r = shape.q_lora_rank
        rules += [
            TensorRule(f"{sa}.linear_q_down_proj.weight", (f"{att}.q_a_proj.weight",),
                       "column", (r, h), i),
            TensorRule(f"{sa}.q_layernorm.weight", (f"{att}.q_a_layernorm.weight",),
                       "replicate", (r,), i),
            TensorRule(f"{sa}.linear_q_up_proj.weight", (f"{att}.q_b_proj.weight",),
                       "column", (q_dim, r), i),
        ]
    else:
        rules.append(TensorRule(f"{sa}.linear_q_proj.weight", (f"{att}.q_proj.weight",),
                                "column", (q_dim, h), i))
    kv = shape.kv_lora_rank
    rules += [
        TensorRule(f"{sa}.linear_kv_down_proj.weight", (f"{att}.kv_a_proj_with_mqa.weight",),
                   "column", (kv + shape.qk_rope_head_dim, h), i),
        TensorRule(f"{sa}.kv_layernorm.weight", (f"{att}.kv_a_layernorm.weight",),
                   "replicate", (kv,), i),
        TensorRule(f"{sa}.linear_kv_up_proj.weight", (f"{att}.kv_b_proj.weight",), "column",
                   (n * (shape.qk_nope_head_dim + shape.v_head_dim), kv), i),
        TensorRule(f"{sa}.linear_proj.weight", (f"{att}.o_proj.weight",), "row",
                   (h, n * shape.v_head_dim), i),
    ]
    return rules


def _indexer_rules(shape: MLAShape, m: str, p: str, i: int | None) -> list[TensorRule]:
    h, d, heads = shape.hidden_size, shape.index_head_dim, shape.index_n_heads
    ix, hx = f"{m}.self_attention.indexer", f"{p}.self_attn.indexer"
    q_in = shape.q_lora_rank or h
    return [
        TensorRule(f"{ix}.linear_wq_b.weight", (f"{hx}.wq_b.weight",), "replicate",
                   (heads * d, q_in), i),
        TensorRule(f"{ix}.linear_wk.weight", (f"{hx}.wk.weight",), "replicate", (d, h), i),
        TensorRule(f"{ix}.k_norm.weight", (f"{hx}.k_norm.weight",), "replicate", (d,), i),
        TensorRule(f"{ix}.k_norm.bias", (f"{hx}.k_norm.bias",), "replicate", (d,), i),
        TensorRule(f"{ix}.linear_weights_proj.weight", (f"{hx}.weights_proj.weight",),
                   "replicate", (heads, h), i),
    ]


def _mlp_layer_rules(shape: MLAShape, m: str, p: str, i: int | None,
                     moe: bool) -> list[TensorRule]:
    h = shape.hidden_size
    if not moe:
        return _mlp_rules(shape, f"{m}.mlp", f"{p}.mlp", shape.ffn_hidden_size, i, None)  # type: ignore[arg-type]
    rules = [
        TensorRule(f"{m}.mlp.router.weight", (f"{p}.mlp.gate.weight",), "replicate",
                   (shape.num_experts, h), i),
        TensorRule(f"{m}.mlp.router.expert_bias", (f"{p}.mlp.gate.e_score_correction_bias",),
                   "replicate", (shape.num_experts,), i),
    ]
    for e in range(shape.num_experts):
        rules += _mlp_rules(shape, f"{m}.mlp.experts.local_experts.{e}", f"{p}.mlp.experts.{e}",
                            shape.moe_ffn_hidden_size, i, e)  # type: ignore[arg-type]
    return rules + _mlp_rules(shape, f"{m}.mlp.shared_experts", f"{p}.mlp.shared_experts",
                              shape.moe_shared_ffn_hidden_size, i, None)  # type: ignore[arg-type]


def _layer_rules(shape: MLAShape, m: str, p: str, i: int | None, moe: bool,
                 indexer: bool) -> list[TensorRule]:
    h = shape.hidden_size
    rules = [TensorRule(f"{m}.input_layernorm.weight", (f"{p}.input_layernorm.weight",),
                        "replicate", (h,), i)]
    rules += _attention_rules(shape, m, p, i)
    if indexer:
        rules += _indexer_rules(shape, m, p, i)
    rules.append(TensorRule(f"{m}.pre_mlp_layernorm.weight",
                            (f"{p}.post_attention_layernorm.weight",), "replicate", (h,), i))
    return rules + _mlp_layer_rules(shape, m, p, i, moe)


def _mtp_rules(shape: MLAShape, k: int) -> list[TensorRule]:
    """The k-th MTP layer, all carried, on the last stage (sharded like a decoder layer)."""
    h = shape.hidden_size
    t, q = f"{MTP_PREFIX}.layers.{k}", f"model.layers.{shape.num_layers + k}"
    rules = [
        TensorRule(f"{t}.enorm.weight", (f"{q}.enorm.weight",), "replicate", (h,)),
        TensorRule(f"{t}.hnorm.weight", (f"{q}.hnorm.weight",), "replicate", (h,)),
        TensorRule(f"{t}.eh_proj.weight", (f"{q}.eh_proj.weight",), "replicate", (h, 2 * h)),
    ]
    rules += _layer_rules(shape, f"{t}.transformer_layer", q, None, moe=True,
                          indexer=shape.index_topk is not None)
    rules.append(TensorRule(f"{t}.final_layernorm.weight", (f"{q}.shared_head.norm.weight",),
                            "replicate", (h,)))
    return rules


def tensor_rules(shape: MLAShape) -> list[TensorRule]:
    """Every tensor of the full model (main layers, then the MTP layers)."""
    v, h = shape.vocab_size, shape.hidden_size
    rules = [TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                        "vocab", (v, h))]
    for i in range(shape.num_layers):
        rules += _layer_rules(shape, f"decoder.layers.{i}", f"model.layers.{i}", i,
                              shape.moe_layers[i], i in shape.indexer_layers)
    for k in range(shape.num_mtp_layers):
        rules += _mtp_rules(shape, k)
    rules.append(TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",),
                            "replicate", (h,)))
    if not shape.tie_word_embeddings:
        rules.append(TensorRule("output_layer.weight", ("lm_head.weight",), "vocab", (v, h)))
    return rules


def carried_rules(shape: MLAShape) -> list[TensorRule]:
    """The rules of tensors megatron does not compute with (indexers, MTP layers)."""
    return [r for r in tensor_rules(shape)
            if ".indexer." in r.mcore or r.mcore.startswith(f"{MTP_PREFIX}.")]
