"""Per-token log-probabilities of token sequences under the megatron model.

Index t of the result is log p(token_t | tokens before t in the same sequence), 0 at each
sequence's first token, so it lines up with token ids, loss masks and the engines'
per-token log-probs. With TP > 1 the logits stay vocab-sharded and megatron's vocab-parallel
cross entropy gives the log-probs directly. Packed batches (one row of concatenated
sequences plus their boundaries) are unpacked to right-padded rows, because plain RoPE in
megatron numbers positions 0..S-1 per row and the local attention has no packed mode.
Gradients flow, so the loss can use these directly. With pipeline parallelism,
`pipelined_token_logprobs` runs megatron's forward-only schedule across the stages (a training
step's schedule runs `stage_forward` and `stage_logprobs` the same way, which under context
parallelism run each CP rank's chunks, context_parallel.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def token_logprobs_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs [B, S] of `input_ids` [B, S] from vocab-parallel logits [B, S, V/TP]."""
    from megatron.core import tensor_parallel

    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float().clone()
    # Cross entropy is -log p; megatron's version all-reduces over the TP group.
    nll = tensor_parallel.vocab_parallel_cross_entropy(scaled, targets)
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=nll.device)
    out[:, 1:] = -nll[:, :-1]
    return out


def forward_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits [B, S, V/TP] of right-padded rows (causal attention, no mask).
    Under sequence parallelism the rows run padded to a multiple of TP and the logits are
    cut back to S; a pipeline stage before the last returns its padded activations."""
    from services.trainer.sequence_parallel import pad_rows, sequence_multiple

    batch, seq = input_ids.shape
    padded = pad_rows(input_ids, sequence_multiple(model))
    position_ids = torch.arange(padded.shape[1], device=input_ids.device)
    output = model(padded, position_ids.unsqueeze(0).expand(batch, -1), None)
    if padded.shape[1] != seq and getattr(model, "post_process", True):
        output = output[:, :seq]
    return output


def stage_forward(stage_model: Any, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A pipeline stage's forward of right-padded rows `input_ids` [B, S] and the context
    parallel rows it ran on (context_parallel.local_rows; None without CP), for
    `stage_logprobs` on the last stage."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() == 1:
        return forward_logits(stage_model, input_ids), None
    from services.trainer.context_parallel import local_rows

    rows = local_rows(input_ids)
    return stage_model(rows.input_ids, rows.position_ids, None), rows


def stage_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, rows: Any, temperature: float = 1.0
) -> torch.Tensor:
    """Whole-row log-probs [B, S] from the last stage's logits of `stage_forward`."""
    if rows is None:
        return token_logprobs_from_logits(logits, input_ids, temperature)
    from services.trainer.context_parallel import logprobs_from_local_logits

    return logprobs_from_local_logits(logits, rows, temperature)


def token_logprobs(model: Any, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, S] of right-padded rows `input_ids` [B, S] (padding only to the right,
    so it never affects the real tokens under causal attention)."""
    return token_logprobs_from_logits(forward_logits(model, input_ids), input_ids, temperature)


def pad_packed(
    tokens: torch.Tensor, cu_seqlens: Sequence[int], pad_id: int = 0
) -> torch.Tensor:
    """Right-padded rows [N, max_len] from a packed 1-D token tensor and its boundaries."""
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    rows = tokens.new_full((len(lengths), max(lengths)), pad_id)
    for i, (start, n) in enumerate(zip(cu_seqlens[:-1], lengths, strict=True)):
        rows[i, :n] = tokens[start : start + n]
    return rows


def unpad_to_packed(values: torch.Tensor, cu_seqlens: Sequence[int]) -> torch.Tensor:
    """The packed 1-D layout of per-row values [N, max_len] (inverse of `pad_packed`)."""
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    return torch.cat([values[i, :n] for i, n in enumerate(lengths)])


def packed_token_logprobs(
    model: Any, tokens: torch.Tensor, cu_seqlens: Sequence[int], temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs of a packed 1-D batch: `tokens` holds the sequences back to back and
    `cu_seqlens` their boundaries (0, len0, len0+len1, ...)."""
    rows = pad_packed(tokens, cu_seqlens)
    return unpad_to_packed(token_logprobs(model, rows, temperature), cu_seqlens)


def pipelined_token_logprobs(
    model: Any, input_ids: torch.Tensor, micro_batch_size: int = 1, temperature: float = 1.0
) -> torch.Tensor | None:
    """Log-probs [B, S] of right-padded rows through megatron's forward-only pipeline
    schedule (any PP size; B must be a multiple of `micro_batch_size`). Every stage calls it;
    the last stage gets the log-probs, the others None. Under CP each stage runs its CP
    rank's chunks (`stage_forward`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    batch, seq = input_ids.shape
    if batch % micro_batch_size:
        raise ValueError(f"batch of {batch} rows is not a multiple of {micro_batch_size}")
    micro_batches = list(input_ids.split(micro_batch_size))
    get_model_config(model).variable_seq_lengths = True  # CP stages pass their local length

    def forward_step(data: Any, stage_model: Any) -> tuple[torch.Tensor, Any]:
        ids = next(data)
        output, rows = stage_forward(stage_model, ids)

        def collect(output: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
            return stage_logprobs(output, ids, rows, temperature)

        return output, collect

    with torch.no_grad():
        collected = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=micro_batch_size,
            forward_only=True,
            collect_non_loss_data=True,
        )
    return torch.cat(list(collected)) if ps.is_pipeline_last_stage() else None
