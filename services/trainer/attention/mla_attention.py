"""The core attention of the MLA model (model_mla.py): causal, optionally restricted to the DSA
indexer's top-k keys per query (sparse_attention.py), at any context-parallel size.

Query and key heads are `qk_nope + qk_rope` wide and value heads `v_head_dim` (megatron's local
DotProductAttention assumes one width; its fused CUDA softmax for causal masks also ignores any
other mask, so this module applies masks itself). Under CP it all-gathers K and V (or the
latent) over the CP group as context_parallel.py's attention does, and masks by row positions.

With DSA, the DSA self-attention also hands over the layer's normalized kv latent, roped key
rope part and up projection (`absorbed`), and the attention runs in the absorbed sparse form
(attention/sparse_mla.py): only sq x k scores per head, the Triton kernel on CUDA. Without
DSA it is torch's SDPA on CUDA at CP 1 (a fused causal kernel), else the exact path below:
[b * heads, sq, S] scores and, with DSA, a boolean [b, sq, S] mask; `exact_dsa = True` keeps
DSA layers on it (the reference the sparse path is tested against).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from services.common.errors import ConfigError
from services.trainer.attention.context_parallel import (
    chunk_positions,
    gather_sequence,
    gathered_positions,
    require_plain_causal,
)
from services.trainer.attention.sparse_mla import absorbed_sparse_attention


@dataclass
class AbsorbedKV:
    """One call's latent KV for the absorbed form: the normalized latent [s, b, r], the roped
    key rope part [s, b, rope] (this rank's tokens) and the kv up projection's weight
    [heads * (qk_nope + v), r] of this rank's heads."""

    latent: Tensor
    k_rope: Tensor
    up_weight: Tensor


class MLACoreAttention(torch.nn.Module):
    """Causal (sparse) attention: query [sq, b, n, dk], key [sk, b, n, dk], value
    [sk, b, n, dv] of this rank's tokens -> [sq, b, n * dv]. `topk_indices` ([b, sq, k] key
    positions, set by the DSA self-attention right before each call) restricts the keys;
    `absorbed`, set with them, lets the sparse form run on the latent."""

    exact_dsa = False  # True: DSA layers on the dense-mask path (the tests' reference)

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps

        require_plain_causal(config, attn_mask_type, "MLA core attention")
        self.config = config
        self.cp_group = getattr(pg_collection, "cp", None) or ps.get_context_parallel_group()
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(k_channels or config.kv_channels)
        self.dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.topk_indices: Tensor | None = None
        self.absorbed: AbsorbedKV | None = None

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        from megatron.core import tensor_parallel

        if attention_mask is not None or attention_bias is not None or packed_seq_params:
            raise ConfigError("MLA core attention takes no mask, bias or packed rows")
        topk, self.topk_indices = self.topk_indices, None  # one call's indices, never reused
        absorbed, self.absorbed = self.absorbed, None
        sq, batch, heads, _ = query.shape
        size = dist.get_world_size(self.cp_group)
        if topk is not None and absorbed is not None and not self.exact_dsa:
            return self._sparse(query, topk, absorbed, value.size(-1))
        if topk is None and size == 1 and query.is_cuda:
            return self._sdpa(query, key, value)
        if size > 1:
            key = gather_sequence(key, self.cp_group, 0, reduce_grad=True)
            value = gather_sequence(value, self.cp_group, 0, reduce_grad=True)
            natural = torch.argsort(gathered_positions(sq * size, size, query.device))
            key, value = key[natural], value[natural]
        sk = key.size(0)
        # [s, b, n, h] -> [b * n, s, h]
        q, k, v = (t.permute(1, 2, 0, 3).reshape(batch * heads, t.size(0), -1)
                   for t in (query, key, value))  # fmt: skip
        scores = torch.baddbmm(q.new_empty((q.size(0), sq, sk)), q, k.transpose(1, 2),
                               beta=0.0, alpha=self.softmax_scale)  # fmt: skip
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        q_pos = query_positions(sq, self.cp_group, query.device)
        masked = torch.arange(sk, device=query.device)[None, :] > q_pos[:, None]  # [sq, sk]
        if topk is not None:
            future = masked
            masked = torch.ones((batch, sq, sk), dtype=torch.bool, device=query.device)
            masked.scatter_(-1, topk, False).logical_or_(future)
            masked = masked.unsqueeze(1)  # [b, 1, sq, sk]: every head alike
        scores = scores.view(batch, heads, sq, sk)
        scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(batch * heads, sq, sk)
        if self.dropout.p > 0 and self.training:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.dropout(probs)
        context = torch.bmm(probs, v).view(batch, heads, sq, -1)
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * v.size(-1))


    def _sparse(self, query: Tensor, topk: Tensor, kv: AbsorbedKV, v_dim: int) -> Tensor:
        if self.dropout.p > 0 and self.training:
            raise ConfigError("sparse MLA attention has no attention dropout; set it to 0")
        sq, batch, heads, _ = query.shape
        latent, k_rope = kv.latent, kv.k_rope
        size = dist.get_world_size(self.cp_group)
        if size > 1:
            latent = gather_sequence(latent, self.cp_group, 0, reduce_grad=True)
            k_rope = gather_sequence(k_rope, self.cp_group, 0, reduce_grad=True)
            natural = torch.argsort(gathered_positions(sq * size, size, query.device))
            latent, k_rope = latent[natural], k_rope[natural]
        rope = k_rope.size(-1)
        up = kv.up_weight.view(heads, -1, latent.size(-1))
        w_uk, w_uv = up.split([up.size(1) - v_dim, v_dim], dim=1)
        q_nope, q_rope = query.transpose(0, 1).split([query.size(-1) - rope, rope], dim=-1)
        context = absorbed_sparse_attention(
            q_nope, q_rope, latent.transpose(0, 1), k_rope.transpose(0, 1), w_uk, w_uv, topk,
            query_positions(sq, self.cp_group, query.device), self.softmax_scale,
        )  # fmt: skip
        return context.transpose(0, 1).reshape(sq, batch, heads * v_dim)

    def _sdpa(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Causal attention by torch's fused SDPA (v padded to the qk width it needs)."""
        sq, batch, heads, dk = query.shape
        dv = value.size(-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, h]
        if dv < dk:
            v = F.pad(v, (0, dk - dv))
        p = self.dropout.p if self.training else 0.0
        if p > 0:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                         scale=self.softmax_scale)
        else:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                     scale=self.softmax_scale)
        context = context[..., :dv]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * dv)


def query_positions(sq: int, cp_group: Any, device: torch.device) -> Tensor:
    """The row positions of this rank's `sq` tokens (megatron's CP chunks when CP > 1)."""
    size = dist.get_world_size(cp_group) if cp_group is not None else 1
    if size == 1:
        return torch.arange(sq, device=device)
    return chunk_positions(sq * size, size, dist.get_rank(cp_group), device)
