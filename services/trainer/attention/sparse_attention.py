"""GLM-5's DeepSeek Sparse Attention (DSA) in the trainer's MLA model.

Every query attends only to the `index_topk` earlier tokens its layer's indexer ranks highest,
as Hugging Face's `GlmMoeDsaAttention` computes it:

- An indexer (`DSAIndexer`) scores each (query, key) pair: query heads from the MLA query
  latent (`q_a_layernorm(q_a_proj(x))`, megatron's normalized `q_compressed`) through `wq_b`,
  one key per token from the layer input through `wk` and a LayerNorm, interleaved RoPE on the
  first `qk_rope_head_dim` dimensions of both, then `sum_h w_h(x) * relu(q_h . k) / sqrt(D)`
  with `w = weights_proj(x) / sqrt(heads)`. Future keys are masked before `topk`, so a query
  with fewer than `index_topk` earlier tokens keeps all of them. Exact ties (every head's
  relu at 0) fall as `torch.topk` breaks them, like Hugging Face, and that depends on the
  row's padded length; with few index heads (tests) ties are common, with GLM-5's 32 rare.
- Only "full" layers (`indexer_types`) run an indexer; each "shared" layer reuses the indices
  of the nearest full layer before it (`TopKSharing`, reset at every decoder forward). A
  pipeline stage must therefore start at a full layer (checked when the model is built).
- The indices go to the MLA core attention (mla_attention.py) with the layer's latent KV
  (`AbsorbedKV`): it computes only the selected scores (attention/sparse_mla.py).
- Under activation recomputation a recomputed full layer runs its indexer again (the same
  indices); the shared layers read the indices kept per full layer for the whole forward.

The indexer weights stay frozen buffers (weight_map_mla.py carries them): the indexer only
selects (top-k has no gradient, as in Hugging Face's `@torch.no_grad` indexer); training it
needs DSA's KL indexer loss against the dense attention, a pre-training objective this RL
trainer does not run. Under context parallelism the indexer keys of the whole row are
all-gathered over the CP group (each rank keeps its queries); under sequence parallelism the
layer input is gathered over TP first. Used by model_mla.py (`use_mla_attention` on the layer
spec, `attach_sharing` on the built model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from torch import Tensor

from services.common.errors import ConfigError
from services.trainer.attention import dsa_index_triton
from services.trainer.attention.context_parallel import gather_sequence, gathered_positions
from services.trainer.attention.mla_attention import AbsorbedKV, MLACoreAttention, query_positions
from services.trainer.model.model_mla import MLAShape

_K_NORM_EPS = 1e-6  # transformers' indexer LayerNorm
_SCORE_BUDGET = 1 << 28  # float32 indexer scores computed at once (1 GiB): chunks of queries


class _Carried(torch.nn.Module):
    """A frozen linear or norm: its weight (and bias) are buffers, never trained."""

    weight: Tensor
    bias: Tensor

    def __init__(self, shape: tuple[int, ...], bias: bool = False) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(shape))
        if bias:
            self.register_buffer("bias", torch.zeros(shape[0]))


def _rope_interleaved(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Hugging Face's `apply_rotary_pos_emb_interleave` on x [b, s, ..., d] at positions [s]:
    pairs (x0, x1), (x2, x3) rotate, the output lists the pairs' first halves then seconds."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float, device=x.device) / d))
    freqs = positions[:, None].float() * inv_freq  # [s, d/2]
    freqs = freqs.view(1, freqs.shape[0], *([1] * (x.dim() - 3)), freqs.shape[1])
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DSAIndexer(torch.nn.Module):
    """One full layer's DSA indexer (Hugging Face's `GlmMoeDsaIndexer`), frozen."""

    def __init__(self, shape: MLAShape) -> None:
        super().__init__()
        h, d, heads = shape.hidden_size, shape.index_head_dim, shape.index_n_heads
        assert shape.index_topk is not None and shape.q_lora_rank
        self.index_topk, self.heads, self.head_dim = shape.index_topk, heads, d
        self.rope_dim, self.rope_theta = shape.qk_rope_head_dim, shape.rope_theta
        self.linear_wq_b = _Carried((heads * d, shape.q_lora_rank))
        self.linear_wk = _Carried((d, h))
        self.k_norm = _Carried((d,), bias=True)
        self.linear_weights_proj = _Carried((heads, h))

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([_rope_interleaved(rot, positions, self.rope_theta), rest], dim=-1)

    @torch.no_grad()
    def forward(self, hidden: Tensor, q_latent: Tensor, positions: Tensor,
                cp_group: Any = None) -> Tensor:
        """Top-k key positions [b, s, k] (int64, in the whole row) of this rank's queries, from
        the layer input `hidden` [s, b, h], the normalized query latent `q_latent` [s, b, r]
        and the tokens' row positions [s]."""
        x, q_latent = hidden.transpose(0, 1), q_latent.transpose(0, 1)  # [b, s, .]
        b, s, _ = x.shape
        q = F.linear(q_latent, self.linear_wq_b.weight).view(b, s, self.heads, self.head_dim)
        q = self._rope(q, positions)
        k = F.layer_norm(F.linear(x, self.linear_wk.weight), (self.head_dim,),
                         self.k_norm.weight, self.k_norm.bias, _K_NORM_EPS)
        k = self._rope(k.unsqueeze(2), positions).squeeze(2)  # [b, s, d]
        num_keys = s
        if cp_group is not None and dist.get_world_size(cp_group) > 1:
            size = dist.get_world_size(cp_group)
            k = gather_sequence(k, cp_group, 1, reduce_grad=False)
            num_keys = s * size
            k = k[:, torch.argsort(gathered_positions(num_keys, size, k.device))]
        # In float32, as transformers keeps weights_proj (_keep_in_fp32_modules).
        weights = F.linear(x.float(), self.linear_weights_proj.weight.float()) * self.heads**-0.5
        topk = min(self.index_topk, num_keys)
        fused = dsa_index_triton.supports(q)
        per_query = b * num_keys * (1 if fused else self.heads)  # float32 scores a query holds
        chunk = max(1, _SCORE_BUDGET // per_query)
        out = []
        for start in range(0, s, chunk):
            end = min(s, start + chunk)
            score = dsa_index_triton.index_scores if fused else _index_scores
            index = score(q[:, start:end], k, weights[:, start:end],
                          positions[start:end], self.head_dim**-0.5)
            out.append(index.topk(topk, dim=-1, sorted=False).indices)
        return torch.cat(out, dim=1)


def _index_scores(q: Tensor, k: Tensor, weights: Tensor, positions: Tensor, scale: float
                  ) -> Tensor:
    """The torch form of the index scores (dsa_index_triton.index_scores' contract), in float32
    as Hugging Face computes them: [b, c, heads, T] scores, relu, the weighted sum over heads."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [b, c, T]
    keys = torch.arange(k.size(1), device=k.device)
    return index.masked_fill(keys[None, :] > positions[:, None], float("-inf"))


@dataclass
class TopKSharing:
    """The indices of every full DSA layer this stage ran in the current forward, by layer
    (kept for the backward's recomputation of the shared layers)."""

    indices: dict[int, Tensor] = field(default_factory=dict, repr=False)

    def reset(self, *_: Any, **__: Any) -> None:
        self.indices = {}


def _gather_tp_sequence(x: Tensor) -> Tensor:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class DSASelfAttention(MLASelfAttention):  # type: ignore[misc]
    """Megatron's MLA self-attention that hands its core attention the DSA top-k indices."""

    def __init__(self, *args: Any, dsa_shape: MLAShape, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layer = self.layer_number - 1  # global, 0-based (Hugging Face's layer_idx)
        full = [i for i in dsa_shape.indexer_layers if i <= self.layer]
        self.indexer = DSAIndexer(dsa_shape) if self.layer in full else None
        self.source = full[-1] if full else None  # the full layer whose top-k this one uses
        self.sharing: TopKSharing | None = None  # attach_sharing sets the model's one

    def get_query_key_value_tensors(self, hidden_states: Tensor, *args: Any,
                                    **kwargs: Any) -> Any:
        out = super().get_query_key_value_tensors(hidden_states, *args, **kwargs)
        self.core_attention.topk_indices = self._topk(hidden_states, out[3])
        self.core_attention.absorbed = self._absorbed(out[1], out[4])
        return out

    def _absorbed(self, key: Tensor, latent: Tensor) -> AbsorbedKV:
        """The latent KV of this call: the normalized latent (gathered over TP under sequence
        parallelism, as the up projection gathers it) and the roped key rope part (every
        head's alike, so head 0's)."""
        if self.config.sequence_parallel and latent.size(0) != key.size(0):
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            latent = gather_from_sequence_parallel_region(latent, tensor_parallel_output_grad=True)
        k_rope = key[:, :, 0, self.config.qk_head_dim:]
        return AbsorbedKV(latent, k_rope, self.linear_kv_up_proj.weight)

    def _topk(self, hidden: Tensor, q_latent: Tensor) -> Tensor:
        if self.sharing is None:
            raise RuntimeError("DSA attention used before attach_sharing")
        if self.indexer is None:
            if self.source not in self.sharing.indices:
                raise RuntimeError(f"DSA layer {self.layer} reuses the top-k of layer"
                                   f" {self.source}, which did not run before it in this forward")
            return self.sharing.indices[self.source]
        if self.config.sequence_parallel:
            hidden, q_latent = _gather_tp_sequence(hidden), _gather_tp_sequence(q_latent)
        cp = self.pg_collection.cp
        positions = query_positions(hidden.shape[0], cp, hidden.device)
        indices = self.indexer(hidden, q_latent, positions, cp)
        self.sharing.indices[self.layer] = indices
        return indices


def use_mla_attention(spec: Any, shape: MLAShape) -> None:
    """Point every layer of a decoder block `spec` at MLACoreAttention and, for a DSA model
    (`index_topk` set), at the DSA self-attention."""
    for layer_spec in spec.layer_specs:
        attention = layer_spec.submodules.self_attention
        attention.submodules.core_attention = MLACoreAttention
        if shape.index_topk is not None:
            attention.module = DSASelfAttention
            attention.params = {**attention.params, "dsa_shape": shape}


def attach_sharing(model: Any, shape: MLAShape) -> None:
    """Give this stage's DSA layers of `model` one `TopKSharing`, reset at every decoder
    forward; refuse layouts where a shared layer could see another forward's indices."""
    layers = list(model.decoder.layers)
    if layers and layers[0].layer_number - 1 not in shape.indexer_layers:
        raise ConfigError(
            f"a pipeline stage starts at decoder layer {layers[0].layer_number - 1}, which"
            " reuses the DSA top-k of a layer on the previous stage; set"
            " trainer.parallel.num_layers_per_stage so every stage starts at an indexer layer"
            f" {list(shape.indexer_layers)}"
        )
    if model.config.recompute_granularity == "selective":
        # A recomputed core attention alone would run without its call's indices; the sparse
        # attention keeps only its inputs and output for the backward anyway.
        raise ConfigError("selective (core attention) recomputation is not supported with DSA"
                          " attention; use trainer.model.recompute_granularity = 'full'")
    sharing = TopKSharing()
    for layer in layers:
        layer.self_attention.sharing = sharing
    model.decoder.register_forward_pre_hook(sharing.reset)
