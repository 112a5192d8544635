"""Per-token log-probabilities of token sequences under the megatron model.

Index t of the result is log p(token_t | tokens before t in the same sequence), 0 at each
sequence's first token, so it lines up with token ids, loss masks and the engines'
per-token log-probs; the probabilities are those of logits / T for the engine's sampling
temperature T. The logits stay vocab-sharded under TP and chunked_logprobs.py scores them
a chunk of tokens at a time, without fp32 copies of the [tokens, vocab] logits;
`token_logprobs` goes further and fuses the output layer into those chunks
(fused_output.py), so no [tokens, vocab] logits outlive their chunk (the pipeline and
context-parallel paths keep the logits).
Micro-batches are right-padded rows [B, S] or packed rows: one row [1, T] of sequences back
to back with their boundaries `cu_seqlens` (0, len0, len0+len1, ...), which run through
megatron's THD path (per-sequence RoPE positions, document-causal attention on the fused
backend), no padding computed; `prefix_of` marks sequences that continue an earlier one of
the row, a group's shared prompt (shared_prefix.py). Gradients flow, so the loss can use
these directly. With
pipeline parallelism, `pipelined_token_logprobs` runs megatron's forward-only schedule across
the stages (a training step's schedule runs `stage_forward` and `stage_logprobs` the same
way, which under context parallelism run each CP rank's chunks, context_parallel.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.common.errors import ConfigError
from services.trainer.attention import shared_prefix
from services.trainer.attention.shared_prefix import PrefixOf
from services.trainer.objective.chunked_logprobs import target_logprobs

#: Sequence boundaries of a packed row (None: right-padded rows).
CuSeqlens = Sequence[int] | None


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """The token after each position [B, S] (0 after the last; packed rows' cross-sequence
    targets are dropped by `align_logprobs`)."""
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    return targets


def _sequence_starts(cu_seqlens: Sequence[int], device: torch.device) -> torch.Tensor:
    """The packed row's sequence starts as an index on `device`, copied without waiting for
    the GPU (from pinned memory): indexing with a Python list would copy it synchronously,
    once forward and once backward, and stall the host that queues the GPU's work."""
    starts = torch.tensor(list(cu_seqlens[:-1]), dtype=torch.long)
    if device.type == "cuda":
        return starts.pin_memory().to(device, non_blocking=True)
    return starts.to(device)


def align_logprobs(next_logprobs: torch.Tensor, cu_seqlens: CuSeqlens = None) -> torch.Tensor:
    """Log-probs of each token [B, S] from those of each position's next token: shifted right
    by one, 0 at every sequence's first token."""
    out = torch.zeros(next_logprobs.shape, dtype=torch.float32, device=next_logprobs.device)
    out[:, 1:] = next_logprobs[:, :-1]
    if cu_seqlens is not None:
        out = out.index_fill(1, _sequence_starts(cu_seqlens, out.device), 0.0)
    return out


def token_logprobs_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
    cu_seqlens: CuSeqlens = None,
) -> torch.Tensor:
    """Log-probs [B, S] of `input_ids` [B, S] from vocab-parallel logits [B, S, V/TP]."""
    next_lp = target_logprobs(logits, next_token_targets(input_ids), temperature)
    return align_logprobs(next_lp, cu_seqlens)


def packed_seq_params(cu_seqlens: Sequence[int], prefix_of: PrefixOf | None = None) -> Any:
    """megatron's THD PackedSeqParams for sequences with boundaries `cu_seqlens` (and, for
    shared prefixes, `prefix_of` tagged on the boundaries tensor). The boundaries stay on the
    CPU: megatron's THD RoPE reads them as Python lengths in every layer, which from a GPU
    tensor would wait for the GPU each time (fused_attention.py copies them to the GPU once
    for its kernel)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = list(cu_seqlens)
    cu = torch.tensor(bounds, dtype=torch.int32)
    if prefix_of is None:
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    else:
        shared_prefix.check_layout(bounds, prefix_of)
        shared_prefix.tag(cu, prefix_of)
        longest = shared_prefix.longest_context(bounds, prefix_of)  # the RoPE table's length
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip


def forward_logits(
    model: Any, input_ids: torch.Tensor, cu_seqlens: CuSeqlens = None,
    prefix_of: PrefixOf | None = None,
) -> torch.Tensor:
    """Vocab-parallel logits [B, S, V/TP] of right-padded rows (causal attention, no mask),
    or of one packed row [1, T] with boundaries `cu_seqlens`. Under sequence parallelism the
    rows run padded to a multiple of TP (a packed row: one extra pad sequence) and the logits
    are cut back to S; a pipeline stage before the last returns its padded activations."""
    from services.trainer.parallel.sequence_parallel import pad_rows, sequence_multiple

    batch, seq = input_ids.shape
    padded = pad_rows(input_ids, sequence_multiple(model))
    position_ids = torch.arange(padded.shape[1], device=input_ids.device)
    packed = None
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"a packed micro-batch is one row, not {batch}")
        extra = [padded.shape[1]] if padded.shape[1] != seq else []  # SP's pad sequence
        layout = None if prefix_of is None else list(prefix_of) + [-1] * len(extra)
        packed = packed_seq_params(list(cu_seqlens) + extra, layout)
    output = model(padded, position_ids.unsqueeze(0).expand(batch, -1), None,
                   packed_seq_params=packed)  # fmt: skip
    if padded.shape[1] != seq and getattr(model, "post_process", True):
        output = output[:, :seq]
    return output


def stage_forward(
    stage_model: Any, input_ids: torch.Tensor, cu_seqlens: CuSeqlens = None
) -> tuple[torch.Tensor, Any]:
    """A pipeline stage's forward of right-padded rows `input_ids` [B, S] (or a packed row)
    and the context parallel rows it ran on (context_parallel.local_rows; None without CP),
    for `stage_logprobs` on the last stage."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() == 1:
        return forward_logits(stage_model, input_ids, cu_seqlens), None
    if cu_seqlens is not None:
        raise ConfigError("packed micro-batches do not run under context parallelism yet;"
                          " set trainer.packed_sequences = false with context_parallel > 1")
    from services.trainer.attention.context_parallel import local_rows

    rows = local_rows(input_ids)
    return stage_model(rows.input_ids, rows.position_ids, None), rows


def stage_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, rows: Any, temperature: float = 1.0,
    cu_seqlens: CuSeqlens = None,
) -> torch.Tensor:
    """Whole-row log-probs [B, S] from the last stage's logits of `stage_forward`."""
    if rows is None:
        return token_logprobs_from_logits(logits, input_ids, temperature, cu_seqlens)
    from services.trainer.attention.context_parallel import logprobs_from_local_logits

    return logprobs_from_local_logits(logits, rows, temperature)


def scored_positions(scored: torch.Tensor) -> torch.Tensor:
    """The flat indices of the positions [B, S] whose next token is scored (`scored`
    nonzero): the rows of the output layer a scored-only forward computes."""
    wanted = torch.zeros(scored.shape, dtype=torch.bool, device=scored.device)
    wanted[:, :-1] = scored[:, 1:] != 0
    return wanted.reshape(-1).nonzero().squeeze(1)


def _fused_next_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
    scored: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    from services.trainer.objective import fused_output

    flat, flat_targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    if scored is None:
        return fused_output.hidden_logprobs(flat, weight, flat_targets, temperature)
    rows = scored_positions(scored)
    picked = fused_output.hidden_logprobs(flat.index_select(0, rows), weight,
                                          flat_targets.index_select(0, rows), temperature)
    return picked.new_zeros(flat_targets.shape).index_copy(0, rows, picked)


def token_logprobs(
    model: Any, input_ids: torch.Tensor, temperature: float = 1.0, cu_seqlens: CuSeqlens = None,
    fused: bool | None = None, prefix_of: PrefixOf | None = None,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs [B, S] of right-padded rows `input_ids` [B, S] (padding only to the right,
    so it never affects the real tokens under causal attention), or of one packed row [1, T]
    with boundaries `cu_seqlens`. With `fused` (and a model whose output layer allows it) the
    output layer runs inside the log-prob chunks (fused_output.py): no [tokens, vocab]
    logits are kept for the backward. None: `fused_output.auto_fused` (off the GPU, or where
    the whole logits would be large). With `scored` [B, S] (the loss mask) the log-probs are
    those of its nonzero positions and 0 elsewhere, and the fused output layer runs only for
    them: in an agent's rows the prompt and the commands' output, most of the tokens, are
    never scored (finding them waits for a GPU once)."""
    from services.trainer.objective import fused_output

    if fused is None:
        fused = fused_output.auto_fused(model, input_ids.numel())
    if not (fused and fused_output.fusable(model)):
        logits = forward_logits(model, input_ids, cu_seqlens, prefix_of)
        out = token_logprobs_from_logits(logits, input_ids, temperature, cu_seqlens)
        return out if scored is None else out.masked_fill(scored == 0, 0.0)
    with fused_output.output_hidden(model) as used:
        hidden = forward_logits(model, input_ids, cu_seqlens, prefix_of)  # [B, S, H]
    targets = next_token_targets(input_ids)
    next_lp = _fused_next_logprobs(hidden, used["weight"], targets, temperature, scored)
    return align_logprobs(next_lp.view(targets.shape), cu_seqlens)


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
