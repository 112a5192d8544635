"""Per-token log-probs of vocab-parallel logits, chunk by chunk, without fp32 copies of them.

`target_logprobs(logits, targets, temperature)` is log_softmax(logits / T)[target] for logits
[..., V/TP] split over the tensor-parallel group by vocabulary (megatron's layout: rank r holds
entries [r * V/TP, (r + 1) * V/TP)). Megatron's vocab_parallel_cross_entropy upcasts the
whole [tokens, V/TP] tensor to fp32 and keeps the softmax for the backward (two fp32 copies;
10+ GB for a 32k-token row and a 150k vocabulary); here the forward keeps only one fp32
log-sum-exp per token, and both directions work through `chunk_tokens` tokens at a time, the
backward recomputing each chunk's softmax and writing the gradient in the logits' dtype (on
CUDA logprob_kernels.py's triton kernels do each direction in one pass over the logits). The
temperature is that of the engine's sampling (the engines return log-probs of logits / T),
so the trainer's log-probs are of the distribution the tokens were drawn from.
Called by logprobs.py and context_parallel.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: Tokens per chunk: at a 150k vocabulary one chunk's fp32 working set is about 2.5 GB.
DEFAULT_CHUNK_TOKENS = 4096


def _tp_group() -> tuple[Any, int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, 1, 0
    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank())  # fmt: skip


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, temperature: float, chunk: int
    ) -> Tensor:
        from services.trainer.objective import logprob_kernels

        group, size, rank = _tp_group()
        flat = logits.reshape(-1, logits.size(-1))
        width = flat.size(1)
        local_targets = targets.reshape(-1) - rank * width  # outside [0, width): another shard
        if logprob_kernels.available(flat):
            lse, picked = logprob_kernels.row_lse_and_target(flat, local_targets, temperature)
        else:
            lse, picked = _torch_lse_and_target(flat, local_targets, temperature, chunk)
        if size > 1:  # combine the shards' log-sum-exps and the one shard's target logit
            shards = [torch.empty_like(lse) for _ in range(size)]
            dist.all_gather(shards, lse, group=group)
            lse = torch.logsumexp(torch.stack(shards), dim=0)
            dist.all_reduce(picked, group=group)
        ctx.save_for_backward(logits, local_targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return (picked - lse).view(targets.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        from services.trainer.objective import logprob_kernels

        logits, local_targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        flat = logits.reshape(-1, logits.size(-1))
        grad = grad.reshape(-1)
        if logprob_kernels.available(flat):
            out = logprob_kernels.row_grad(flat, local_targets, lse, grad, temperature)
        else:
            out = _torch_grad(flat, local_targets, lse, grad, temperature, chunk)
        return out.view(logits.shape), None, None, None


def _torch_lse_and_target(
    flat: Tensor, local_targets: Tensor, temperature: float, chunk: int
) -> tuple[Tensor, Tensor]:
    width = flat.size(1)
    in_shard = (local_targets >= 0) & (local_targets < width)
    index = local_targets.clamp(0, width - 1).unsqueeze(1)
    lse = torch.empty(flat.size(0), dtype=torch.float32, device=flat.device)
    picked = torch.empty_like(lse)
    for start in range(0, flat.size(0), chunk):
        part = flat[start : start + chunk].float() / temperature
        lse[start : start + chunk] = torch.logsumexp(part, dim=-1)
        picked[start : start + chunk] = part.gather(1, index[start : start + chunk]).squeeze(1)
    return lse, torch.where(in_shard, picked, torch.zeros_like(picked))


def _torch_grad(
    flat: Tensor, local_targets: Tensor, lse: Tensor, grad: Tensor, temperature: float,
    chunk: int,
) -> Tensor:
    width = flat.size(1)
    in_shard = (local_targets >= 0) & (local_targets < width)
    index = local_targets.clamp(0, width - 1).unsqueeze(1)
    grad = grad.float() / temperature
    out = torch.empty_like(flat)
    for start in range(0, flat.size(0), chunk):
        end = start + chunk
        g = grad[start:end].unsqueeze(1)
        # d/dz (z_target - lse) = onehot(target) - softmax(z), z = logits / T
        part = torch.exp(flat[start:end].float() / temperature - lse[start:end].unsqueeze(1))
        part.mul_(-g)
        part.scatter_add_(1, index[start:end], g * in_shard[start:end].unsqueeze(1))
        out[start:end] = part
    return out


def target_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """fp32 log p(target) [...] under softmax(logits / temperature) of vocab-parallel logits
    [..., V/TP] (see the module doc); differentiable in `logits`."""
    if temperature <= 0:
        raise ValueError(f"sampling temperature must be positive, not {temperature}")
    return _TargetLogprobs.apply(logits, targets, float(temperature), int(chunk_tokens))  # type: ignore[no-any-return]
