"""The output layer fused with the chosen token's log-prob: no [tokens, vocab] logits kept.

`hidden_logprobs(hidden, weight, targets, temperature)` is log_softmax(hidden @ weight.T / T)
[target] for this TP rank's vocabulary shard of the output weight [V/TP, H] (megatron's
layout), computed `chunk_tokens` tokens at a time: each chunk's logits [chunk, V/TP] exist
only while its log-sum-exp and target logit are read off them (chunked_logprobs.py's triton
kernels on CUDA, its torch chunks elsewhere), and the backward recomputes them chunk by chunk
to form d/d hidden and d/d weight (the weight's gradient summed in fp32). Only the hidden
states, the targets and one fp32 log-sum-exp per token are saved. Under TP the shards'
log-sum-exps and target logits are combined as in chunked_logprobs.py; the hidden states'
gradient from this rank's shard is summed over the group by megatron's own mapping
(`output_hidden`, as its ColumnParallelLinear does).

`output_hidden(model)` swaps the last stage's output layer for one that hands back its
(sequence-parallel-gathered) input and the weight it would multiply by, so the model's
forward returns hidden states [B, S, H] instead of logits.
Called by logprobs.py (`token_logprobs`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from services.trainer.objective import chunked_logprobs, logprob_kernels
from services.trainer.optim.contiguous_grad import contiguous_grad

#: Tokens per chunk: a chunk's logits are chunk x V/TP in the weight's dtype (bf16 at a 150k
#: vocabulary: 0.6 GB), plus an fp32 copy on the CPU path.
DEFAULT_CHUNK_TOKENS = 2048
#: Whole logits of a micro-batch past this size make `auto_fused` fuse on a GPU too: a
#: 65,536-token row of a 154,880-word vocabulary is 19 GiB of bf16 logits, and as much again
#: for their gradient.
LARGE_LOGITS_BYTES = 4 * 2**30
#: Rows per fp32 pass of the torch path (the CPU): its fp32 temporaries are a few
#: [rows, V/TP] tensors, live at the backward's start, when activations peak.
TORCH_ROWS = 256


def _lse_and_target(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    if logprob_kernels.available(logits):
        return logprob_kernels.row_lse_and_target(logits, targets, temperature)
    return chunked_logprobs._torch_lse_and_target(logits, targets, temperature, TORCH_ROWS)


def _logits_grad(logits: Tensor, targets: Tensor, lse: Tensor, grad: Tensor,
                 temperature: float) -> Tensor:  # fmt: skip
    if logprob_kernels.available(logits):
        return logprob_kernels.row_grad(logits, targets, lse, grad, temperature)
    return chunked_logprobs._torch_grad(logits, targets, lse, grad, temperature, TORCH_ROWS)


class _HiddenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
        chunk: int,
    ) -> Tensor:
        group, size, rank = chunked_logprobs._tp_group()
        local = targets - rank * weight.size(0)  # outside [0, V/TP): another rank's shard
        lse = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
        picked = torch.empty_like(lse)
        for start in range(0, hidden.size(0), chunk):
            end = start + chunk
            logits = hidden[start:end] @ weight.t()
            lse[start:end], picked[start:end] = _lse_and_target(logits, local[start:end],
                                                                temperature)  # fmt: skip
            del logits
        if size > 1:  # combine the shards' log-sum-exps and the one shard's target logit
            shards = [torch.empty_like(lse) for _ in range(size)]
            dist.all_gather(shards, lse, group=group)
            lse = torch.logsumexp(torch.stack(shards), dim=0)
            dist.all_reduce(picked, group=group)
        ctx.save_for_backward(hidden, weight, local, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, local, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if ctx.needs_input_grad[1] else None)  # fmt: skip
        for start in range(0, hidden.size(0), ctx.chunk):
            end = start + ctx.chunk
            h = hidden[start:end]
            logits = h @ weight.t()  # recomputed: the forward kept none
            g = _logits_grad(logits, local[start:end], lse[start:end], grad[start:end],
                             ctx.temperature)  # fmt: skip
            del logits
            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[start:end])
            if grad_weight is not None:  # each chunk's product summed in fp32
                grad_weight.add_(g.t() @ h)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None)  # fmt: skip


def hidden_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> Tensor:
    """fp32 log p(target) [N] under softmax(hidden @ weight.T / temperature) for hidden states
    [N, H] and this rank's vocabulary shard `weight` [V/TP, H]; differentiable in both.
    `chunk_tokens` defaults to DEFAULT_CHUNK_TOKENS as it is at the call."""
    if temperature <= 0:
        raise ValueError(f"sampling temperature must be positive, not {temperature}")
    chunk = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    return _HiddenLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk))  # type: ignore[no-any-return]


def on_cuda(model: Any) -> bool:
    """Whether `model`'s parameters live on a GPU."""
    return any(p.is_cuda for p in model.parameters())


def logits_bytes(model: Any, tokens: int) -> int:
    """The size of `tokens` tokens' whole logits from `model`'s output layer (this rank's
    vocabulary shard, the weight's dtype)."""
    layer = getattr(model, "output_layer", None)
    weight = getattr(layer, "weight", None)
    if weight is None and hasattr(model, "shared_embedding_or_output_weight"):
        weight = model.shared_embedding_or_output_weight()  # tied to the embedding
    return 0 if weight is None else tokens * weight.size(0) * weight.element_size()


def auto_fused(model: Any, tokens: int) -> bool:
    """`fused_output_logprobs = "auto"`: fused where the model lives in host RAM (host memory
    is what runs short there), and on a GPU where the whole logits of the micro-batch would
    pass LARGE_LOGITS_BYTES; elsewhere on a GPU the logits are kept (a recomputed chunk costs
    more than it saves)."""
    return not on_cuda(model) or logits_bytes(model, tokens) > LARGE_LOGITS_BYTES


def fusable(model: Any) -> bool:
    """Whether `model`'s logits can be fused into the log-probs: the last pipeline stage of a
    GPT model whose output layer is one plain vocab-parallel linear (no MTP heads)."""
    layer = getattr(model, "output_layer", None)
    return (getattr(model, "post_process", False) and layer is not None
            and getattr(model.config, "mtp_num_layers", None) is None
            and getattr(layer, "bias", None) is None)  # fmt: skip


@contextmanager
def output_hidden(model: Any) -> Iterator[dict[str, Tensor]]:
    """While open, `model`'s forward returns the output layer's input [B, S, H] (gathered
    over the sequence-parallel group, with the backward's reduce-scatter or all-reduce over
    TP that megatron's ColumnParallelLinear applies) in place of logits; the yielded dict's
    "weight" is the weight the layer would have used (the embedding's when tied)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer = model.output_layer
    seen: dict[str, Tensor] = {}

    def forward(input_: Tensor, weight: Tensor | None = None, **_: Any) -> tuple[Tensor, None]:
        seen["weight"] = layer.weight if weight is None else weight
        group = layer.tp_group
        if layer.sequence_parallel:
            out = gather_from_sequence_parallel_region(input_, group=group)
        else:
            out = copy_to_tensor_model_parallel_region(input_, group=group)
        return contiguous_grad(out), None

    layer.forward = forward
    try:
        yield seen
    finally:
        del layer.forward
