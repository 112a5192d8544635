"""Gradients across ranks: data-parallel all-reduce, and clipping by the global norm.

Each rank holds a shard of the tensor-parallel parameters and a full copy of the replicated
ones (norms; identical gradients on every TP rank without sequence parallelism). The global
squared norm sums the shards' squares over the model-parallel group and counts each
replicated parameter once (on TP rank 0). Used by megatron_policy.py when the world is > 1;
the formula matches `torch.nn.utils.clip_grad_norm_`, so TP=1 and TP=2 clip alike.
Data-parallel ranks train different micro-batches whose losses are already weighted by
their share of the whole minibatch's tokens, so the gradients are summed over the DP group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def clip_model_parallel_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> float:
    """Scale the gradients of `params` so their global L2 norm is at most `max_norm`; returns
    the global norm before clipping."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            squared += p.grad.detach().float().pow(2).sum()
    if dist.is_initialized() and ps.model_parallel_is_initialized():
        dist.all_reduce(squared, group=ps.get_model_parallel_group())
    norm = squared.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return float(norm)


def all_reduce_data_parallel_grads(params: Sequence[torch.Tensor]) -> None:
    """Sum the gradients of `params` over the data-parallel group (a rank that trained no
    micro-batch contributes zeros)."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
