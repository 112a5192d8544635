"""The core attention of the MLA model (model_mla.py): causal, optionally restricted to the DSA
indexer's top-k keys per query (sparse_attention.py), at any context-parallel size.

Query and key heads are `qk_nope + qk_rope` wide and value heads `v_head_dim` (megatron's local
DotProductAttention assumes one width; its fused CUDA softmax for causal masks also ignores any
other mask, so this module applies masks itself). Under CP it all-gathers K and V over the CP
group as context_parallel.py's attention does, and masks by row positions.

The DSA mask here is dense: a boolean [b, sq, S] per row, shared by every head (the indices
are shared across heads), on top of the [b * heads, sq, S] scores the local attention already
materializes. A fused sparse-MLA kernel (FlashMLA's sparse prefill, or a TileLang/Triton
kernel) takes the [b, sq, k] indices directly and computes only sq x k scores per head.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from services.common.errors import ConfigError
from services.trainer.attention.context_parallel import (
    chunk_positions,
    gather_sequence,
    gathered_positions,
    require_plain_causal,
)


class MLACoreAttention(torch.nn.Module):
    """Causal (sparse) attention: query [sq, b, n, dk], key [sk, b, n, dk], value
    [sk, b, n, dv] of this rank's tokens -> [sq, b, n * dv]. `topk_indices` ([b, sq, k] key
    positions, set by the DSA self-attention right before each call) restricts the keys."""

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
        sq, batch, heads, _ = query.shape
        size = dist.get_world_size(self.cp_group)
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


def query_positions(sq: int, cp_group: Any, device: torch.device) -> Tensor:
    """The row positions of this rank's `sq` tokens (megatron's CP chunks when CP > 1)."""
    size = dist.get_world_size(cp_group) if cp_group is not None else 1
    if size == 1:
        return torch.arange(sq, device=device)
    return chunk_positions(sq * size, size, dist.get_rank(cp_group), device)
