"""The token dispatch of the MoE layers without a Python loop over experts.

megatron's allgather dispatcher (one expert-parallel rank, and EP on the CPU) permutes tokens
by expert with index ops. Its alltoall dispatcher (EP > 1 on CUDA) does too, but then regroups
the received chunks, one per (source rank, local expert), from rank-major to expert-major
order; without TransformerEngine's fused kernel that is `sort_chunks_by_idxs`, a split and a
Python list of EP x local-experts chunks handed to one cat, on every forward and backward.
`sort_chunks_by_index` is the same permutation as one gather: each output row's source row
from the chunk sizes and order, computed on the device. `use_index_sorted_chunks` installs it
in the dispatcher module (idempotent); called by model.moe_experts_spec with grouped experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def sort_chunks_by_index(input: Tensor, split_sizes: Tensor, sorted_idxs: Tensor,
                         probs: Tensor | None = None,
                         fused: bool = False) -> tuple[Tensor, Tensor | None]:
    """The rows of `input`, cut into chunks of `split_sizes`, reordered chunk by chunk as
    `sorted_idxs` lists them (megatron's `sort_chunks_by_idxs`); `probs` likewise."""
    device = input.device
    sizes = split_sizes.to(device=device, dtype=torch.int64)
    order = sorted_idxs.to(device=device, dtype=torch.int64)
    starts = sizes.cumsum(0) - sizes
    out_sizes = sizes[order]
    out_starts = out_sizes.cumsum(0) - out_sizes
    rows = input.shape[0]
    chunk = torch.repeat_interleave(torch.arange(order.numel(), device=device), out_sizes,
                                    output_size=rows)
    source = starts[order][chunk] + torch.arange(rows, device=device) - out_starts[chunk]
    permuted_probs = None if probs is None else probs.index_select(0, source)
    return input.index_select(0, source), permuted_probs


def use_index_sorted_chunks() -> None:
    """Have megatron's token dispatchers regroup chunks with `sort_chunks_by_index`."""
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.sort_chunks_by_idxs = _index_sorted_chunks


def _index_sorted_chunks(input: Tensor, split_sizes: Tensor, sorted_idxs: Tensor,
                         probs: Tensor | None = None, fused: bool = False) -> Any:
    if fused:  # TransformerEngine's kernel, where configured: megatron's own path
        from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

        return sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs, fused)
    return sort_chunks_by_index(input, split_sizes, sorted_idxs, probs)
