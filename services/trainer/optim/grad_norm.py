"""Gradients across ranks: the data-parallel sums, and clipping by the global norm.

A rank holds three kinds of parameters, and each kind is made whole over its own group:
- dense parameters (attention, dense MLPs, norms, embeddings) are replicated over data and
  context parallelism: each DP rank trained other micro-batches and each CP rank other
  tokens, with losses already weighted by their share of the minibatch, so their gradients
  are summed over the DP x CP group;
- expert parameters (megatron marks them `allreduce = False`) live on one EP rank each and
  are replicated only over the expert-data-parallel group, so they are summed there;
- with pipeline parallelism and tied embeddings the last stage keeps a copy of the word
  embeddings (`shared_embedding`): first and last stage sum that gradient over megatron's
  embedding group, so both copies take the same step;
- replicated parameters that each TP rank trains on its own tokens or heads only (norms and
  MoE routers under sequence parallelism, per-head q/k norms; sequence_parallel.py) have
  their gradients summed over TP first.

The global norm counts every distinct parameter once: dense shards over TP x PP (replicated
norms on TP rank 0 only, the last stage's embedding copy not at all) and expert shards over
expert-TP x EP x PP. The formula matches `torch.nn.utils.clip_grad_norm_`, so every layout
clips like one rank. Used by megatron_policy.py whenever the world is larger than one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether megatron placed `param` on one expert-parallel rank (no plain DP all-reduce)."""
    return not getattr(param, "allreduce", True)


def _sum(grads: list[torch.Tensor], group: Any) -> None:
    if grads and dist.get_world_size(group=group) > 1:
        for g in grads:
            dist.all_reduce(g, group=group)


def all_reduce_data_parallel_grads(params: Sequence[torch.Tensor]) -> None:
    """Make the gradients of `params` whole across ranks (a parameter without a gradient,
    e.g. on a rank that trained no micro-batch, contributes zeros)."""
    from megatron.core import parallel_state as ps

    from services.trainer.parallel.sequence_parallel import grads_partial_over_tp

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _sum([p.grad for p in params if grads_partial_over_tp(p)],  # type: ignore[misc]
         ps.get_tensor_model_parallel_group())  # fmt: skip
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        _sum([p.grad for p in params if getattr(p, "shared_embedding", False)],  # type: ignore[misc]
             ps.get_embedding_group())  # fmt: skip
    dense = [p.grad for p in params if not is_expert_param(p)]
    expert = [p.grad for p in params if is_expert_param(p)]
    _sum(dense, ps.get_data_parallel_group(with_context_parallel=True))  # type: ignore[arg-type]
    _sum(expert, ps.get_expert_data_parallel_group())  # type: ignore[arg-type]


def _squared_norm(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    squared = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if (
            p.grad is not None
            and param_is_not_tensor_parallel_duplicate(p)
            and not getattr(p, "shared", False)
        ):
            squared += p.grad.detach().float().pow(2).sum()
    return squared


def clip_model_parallel_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> float:
    """Scale the gradients of `params` so their global L2 norm is at most `max_norm`; returns
    the global norm before clipping."""
    from megatron.core import parallel_state as ps

    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    dense = _squared_norm([p for p in params if not is_expert_param(p)], device)
    expert = _squared_norm([p for p in params if is_expert_param(p)], device)
    if dist.is_initialized() and ps.model_parallel_is_initialized():
        # Every rank joins both sums (a pipeline stage may hold no experts at all).
        dist.all_reduce(dense, group=ps.get_model_parallel_group())
        dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    norm = (dense + expert).sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return float(norm)
