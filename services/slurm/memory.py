"""Memory estimates of a deployment, each with the formula it comes from.

From a model's Hugging Face config (a dict of config.json's keys: dense, MoE and multi-head
latent attention models) and the deployment's trainer and engine settings: per trainer rank
the weights, gradients, optimizer state (on disk or not) and activations, per engine GPU the
weights and the KV tokens left at the memory fraction. Estimates for planning, not
measurements; `plan` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of one model, split the way the parallel layouts split them."""

    num_layers: int
    num_dense_layers: int
    hidden: int
    vocab: int
    attention_per_layer: int
    dense_mlp_per_layer: int
    experts_per_layer: int  # routed experts only; shared experts count as dense
    shared_per_moe_layer: int
    kv_values_per_token_per_layer: int
    num_experts: int
    num_experts_per_token: int
    kv_split_over_tp: bool  # KV heads are split over TP ranks; MLA's latent is replicated

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def total(self) -> int:
        return (2 * self.embedding + self.num_layers * self.attention_per_layer
                + self.num_dense_layers * self.dense_mlp_per_layer
                + self.num_moe_layers * (self.experts_per_layer + self.shared_per_moe_layer))

    @property
    def active(self) -> int:
        routed = self.num_moe_layers * self.experts_per_layer
        return self.total - routed + routed * self.num_experts_per_token // max(1, self.num_experts)


def model_size(hf: dict[str, Any]) -> ModelSize:
    """Parameter counts from a config.json dict (norms and biases left out: they are tiny)."""
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    if hf.get("kv_lora_rank"):  # multi-head latent attention
        nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        q_lora, kv_lora = hf.get("q_lora_rank") or 0, hf["kv_lora_rank"]
        q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        attention = q + h * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * h
        if hf.get("index_topk"):  # the DSA indexer: its query, key and head weights
            attention += (q_lora * hf["index_n_heads"] * hf["index_head_dim"]
                          + h * hf["index_head_dim"] + h * hf["index_n_heads"])
        kv_values = kv_lora + rope
    else:
        head_dim = hf.get("head_dim") or h // heads
        kv_heads = hf.get("num_key_value_heads") or heads
        attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
        kv_values = 2 * kv_heads * head_dim
    num_experts = hf.get("n_routed_experts") or hf.get("num_experts") or 0
    moe_ffn = hf.get("moe_intermediate_size") or 0
    dense_layers = hf.get("first_k_dense_replace", 0) if num_experts else layers
    return ModelSize(
        num_layers=layers, num_dense_layers=dense_layers, hidden=h, vocab=hf["vocab_size"],
        attention_per_layer=attention, dense_mlp_per_layer=3 * h * hf["intermediate_size"],
        experts_per_layer=3 * h * moe_ffn * num_experts + h * num_experts,
        shared_per_moe_layer=3 * h * moe_ffn * (hf.get("n_shared_experts") or 0),
        kv_values_per_token_per_layer=kv_values, num_experts=num_experts,
        num_experts_per_token=hf.get("num_experts_per_tok") or 0,
        kv_split_over_tp=not hf.get("kv_lora_rank"),
    )


@dataclass(frozen=True)
class Estimate:
    """One line of the memory plan: what, how many GB, and the formula."""

    what: str
    gb: float
    formula: str


def trainer_rank(size: ModelSize, trainer: Any) -> list[Estimate]:
    """HBM of the fullest trainer rank: the pipeline stage with the most parameters."""
    p = trainer.parallel
    tp, pp, cp, ep = p.tensor_parallel, p.pipeline_parallel, p.context_parallel, p.expert_parallel
    stages = p.num_layers_per_stage or _even_split(size.num_layers, pp)
    dtype_bytes = 4 if trainer.model.dtype == "float32" else 2
    best = (0, 0, 0)
    first = 0
    for i, layers in enumerate(stages):
        moe = max(0, first + layers - max(first, size.num_dense_layers))
        dense = layers - moe
        shard = (layers * size.attention_per_layer + dense * size.dense_mlp_per_layer
                 + moe * size.shared_per_moe_layer
                 + size.embedding * ((i == 0) + (i == pp - 1))) // tp
        shard += moe * size.experts_per_layer // ep
        if shard > best[0]:
            best = (shard, i, layers)
        first += layers
    params, stage, layers = best
    dp = max(1, trainer.parallel.data_parallel or 1)
    moment_bytes = 4 if trainer.optimizer.moments_dtype == "float32" else 2
    state_bytes = 4 + 2 * moment_bytes
    tokens = trainer.max_tokens_per_microbatch
    in_flight = min(pp - stage, pp)
    out = [
        Estimate("parameters on the rank (billions)", params / 1e9,
                 f"stage {stage} ({layers} layers): (attention + dense MLP + shared experts "
                 f"+ embeddings) / TP{tp} + routed experts / EP{ep}, in billions"),
        Estimate("weights", params * dtype_bytes / GB, f"parameters x {dtype_bytes} bytes"),
        Estimate("gradients", params * dtype_bytes / GB,
                 f"parameters x {dtype_bytes} bytes (grad buffer in the parameter dtype)"),
    ]
    state = params * state_bytes / dp / GB
    if trainer.optimizer.stream_optimizer_state_to_disk:
        out.append(Estimate("optimizer state (on local disk)", state,
                            f"parameters x {state_bytes} bytes / DP{dp}; in HBM only one bucket"))
        out.append(Estimate("optimizer bucket in memory", 3 * trainer.optimizer.bucket_mb
                            * 2**20 / GB, "3 x optimizer.bucket_mb (master + two moments)"))
    else:
        out.append(Estimate("optimizer state (in HBM)", state,
                            f"parameters x {state_bytes} bytes (fp32 master + 2 moments) / DP{dp}"))
    per_layer = tokens * size.hidden * 2 / (tp if p.sequence_parallel else 1)
    working = tokens * size.hidden * 34 / tp
    out.append(Estimate(
        "activations, full recompute", (in_flight * layers * per_layer + working) / GB,
        f"{in_flight} micro-batch(es) in flight x {layers} layers x {tokens} tokens x hidden "
        f"{size.hidden} x 2 bytes / TP (layer inputs) + one layer recomputed: tokens x hidden"
        " x 34 bytes / TP"))
    out.append(Estimate(
        "activations, no recompute", in_flight * layers * working / GB,
        f"{in_flight} micro-batch(es) in flight x {layers} layers x tokens x hidden x 34 bytes"
        " / TP"))
    out.append(Estimate("logits (last stage)", tokens * size.vocab * 4 / tp / GB,
                        f"{tokens} tokens x vocab {size.vocab} x 4 bytes / TP{tp}"))
    _ = cp  # CP splits each row; the token budget above is already per rank
    return out


def engine_gpu(size: ModelSize, sglang: Any, gpu_memory_gb: float,
               weight_bytes: float) -> list[Estimate]:
    """HBM of one engine GPU and the KV tokens that fit at mem_fraction_static."""
    tp, ep = sglang.tp_size, max(1, sglang.ep_size)
    attention_shards = 1 if sglang.enable_dp_attention else tp
    dense = size.total - size.num_moe_layers * size.experts_per_layer
    experts = size.num_moe_layers * size.experts_per_layer
    weights = (dense / attention_shards + experts / ep) * weight_bytes
    fraction = sglang.mem_fraction_static or 0.9
    kv_bytes = 1 if (sglang.kv_cache_dtype or "").startswith("fp8") else 2
    kv_shards = attention_shards if size.kv_split_over_tp else 1
    per_token = size.kv_values_per_token_per_layer * size.num_layers * kv_bytes / kv_shards
    budget = max(0.0, fraction * gpu_memory_gb * GB - weights)
    return [
        Estimate("weights per GPU", weights / GB,
                 f"non-expert params / {attention_shards} + expert params / EP{ep}, "
                 f"x {weight_bytes} bytes"),
        Estimate("KV per token (KB)", per_token / 1e3,
                 f"{size.kv_values_per_token_per_layer} values x {size.num_layers} layers x "
                 f"{kv_bytes} bytes / {kv_shards}"),
        Estimate("KV budget per GPU", budget / GB,
                 f"mem_fraction_static {fraction} x {gpu_memory_gb} GB - weights"),
        Estimate("KV tokens per GPU (millions)", budget / per_token / 1e6 if per_token else 0.0,
                 "KV budget / KV bytes per token (each dp-attention rank its own pool)"),
    ]


def _even_split(layers: int, stages: int) -> list[int]:
    return [layers // stages + (i < layers % stages) for i in range(stages)]
