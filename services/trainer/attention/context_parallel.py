"""Context parallelism (CP) on megatron's local layer spec, without TransformerEngine.

Megatron's load-balanced layout: a row of S tokens (right-padded to a multiple of 2*CP) is
cut into 2*CP chunks and CP rank r holds chunks r and 2*CP-1-r, so every rank does about the
same share of causal attention. Megatron's RotaryEmbedding already slices the rope table this
way when CP > 1; what the local spec lacks is attention across the chunks.
`ContextParallelAttention` replaces the local spec's core attention: it all-gathers K and V
over the CP group (the backward reduce-scatters their gradients) and attends causally from this
rank's queries, with GQA. `cp_token_logprobs` is the log-prob function under CP: each rank
runs the model on its chunks (`local_rows`) and the log-probs are all-gathered back to the
full [B, S] (`gather_logprobs`), so the loss runs unchanged and identically on every CP
rank; each rank's backward then yields the gradient of its own tokens, and grad_norm.py sums
the gradients over DP x CP.
Used by model.py (`with_core_attention` on the layer spec) and megatron_policy.py.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from services.common.errors import ConfigError


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` over `group`, in rank order. Backward: the sum of every rank's
    gradient of this rank's part (reduce-scatter) when `reduce` is set, for tensors that each
    rank uses differently (K, V); otherwise this rank's slice, for values that every rank
    consumes identically (log-probs feeding the same loss)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int, reduce: bool) -> Tensor:
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        group, dim = ctx.group, ctx.dim
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if ctx.reduce:
            if dist.get_backend(group) == "gloo":  # gloo has no reduce_scatter
                grad = grad.contiguous().clone()
                dist.all_reduce(grad, group=group)
            else:
                parts = [p.contiguous() for p in grad.chunk(size, dim=dim)]
                out = torch.empty_like(parts[rank])
                dist.reduce_scatter(out, parts, group=group)
                return out, None, None, None
        return grad.chunk(size, dim=dim)[rank].contiguous(), None, None, None


def gather_sequence(x: Tensor, group: Any, dim: int, reduce_grad: bool) -> Tensor:
    """`x` of every rank of `group` concatenated along `dim` (autograd-aware)."""
    return _GatherSequence.apply(x, group, dim, reduce_grad)  # type: ignore[no-any-return]


def chunk_positions(seq_len: int, cp_size: int, cp_rank: int, device: Any = None) -> Tensor:
    """The positions of a row of `seq_len` tokens (a multiple of 2*cp_size) that CP rank
    `cp_rank` holds: chunks cp_rank and 2*cp_size-1-cp_rank, in that order."""
    chunk = seq_len // (2 * cp_size)
    starts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def gathered_positions(seq_len: int, cp_size: int, device: Any = None) -> Tensor:
    """The positions of the CP ranks' chunks concatenated in rank order (an all-gather)."""
    return torch.cat([chunk_positions(seq_len, cp_size, r, device) for r in range(cp_size)])


def cp_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def require_plain_causal(config: Any, attn_mask_type: Any, what: str) -> None:
    """Raise ConfigError unless the attention is plainly causal with a vanilla softmax (all the
    core attentions written here compute)."""
    from megatron.core.transformer.enums import AttnMaskType

    if attn_mask_type != AttnMaskType.causal or config.window_size is not None:
        raise ConfigError(f"{what} supports plain causal masks only")
    if config.softmax_type != "vanilla":
        raise ConfigError(f"{what}: softmax {config.softmax_type!r} is not supported")


class CausalCoreAttention(torch.nn.Module):
    """What the core attentions written here share: megatron DotProductAttention's
    constructor, a plain causal mask, the softmax scale, dropout and the CP group."""

    name = "context parallel attention"

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()

        require_plain_causal(config, attn_mask_type, self.name)
        self.config = config
        self.group = getattr(pg_collection, "cp", None) or cp_group()
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )


class ContextParallelAttention(CausalCoreAttention):
    """Causal core attention of this CP rank's query chunks against the whole sequence.

    Takes the arguments megatron's DotProductAttention takes; query [sq, b, np, hn], key and
    value [sk, b, ng, hn] hold this rank's chunks; returns [sq, b, np * hn]."""

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
        if attention_mask is not None or attention_bias is not None or packed_seq_params:
            raise ConfigError("context parallel attention takes no mask, bias or packed rows")
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        key = gather_sequence(key, self.group, 0, reduce_grad=True)
        value = gather_sequence(value, self.group, 0, reduce_grad=True)
        # Back to sequence order: the sums of softmax and context then run as at CP = 1.
        natural = torch.argsort(gathered_positions(query.size(0) * size, size, query.device))
        return self.attend(query, key[natural], value[natural], rank, size)

    def attend(self, query: Tensor, key: Tensor, value: Tensor, rank: int, size: int) -> Tensor:
        """Causal attention of this rank's query chunks [sq, b, np, hn] against the whole
        sequence's keys and values [S, b, ng, hn], in sequence order; [sq, b, np * hn]."""
        from megatron.core import tensor_parallel

        sq, batch, heads, _ = query.shape
        if heads != key.size(2):
            key = key.repeat_interleave(heads // key.size(2), dim=2)
            value = value.repeat_interleave(heads // value.size(2), dim=2)
        # [s, b, n, h] -> [b * n, s, h]
        q, k, v = (t.permute(1, 2, 0, 3).reshape(batch * heads, t.size(0), -1)
                   for t in (query, key, value))  # fmt: skip
        scores = torch.baddbmm(q.new_empty((q.size(0), sq, k.size(1))), q, k.transpose(1, 2),
                               beta=0.0, alpha=self.softmax_scale)  # fmt: skip
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        q_pos = chunk_positions(sq * size, size, rank, query.device)
        future = torch.arange(sq * size, device=query.device).unsqueeze(0) > q_pos.unsqueeze(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.dropout.p > 0 and self.training:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.dropout(probs)
        context = torch.bmm(probs, v).view(batch, heads, sq, -1)
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * v.size(-1))


def with_core_attention(spec: Any, core_attention: Any) -> Any:
    """A copy of a GPT layer spec (or block spec) whose self-attention uses `core_attention`
    (this module's `ContextParallelAttention`, or fused_attention.py's)."""
    spec = copy.deepcopy(spec)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        layer.submodules.self_attention.submodules.core_attention = core_attention
    return spec


@dataclass(frozen=True)
class LocalRows:
    """This CP rank's chunks of a batch of right-padded rows, and what it needs to score them."""

    input_ids: Tensor  # [B, 2 * chunk]: this rank's tokens
    position_ids: Tensor  # [B, 2 * chunk]: their positions in the row
    targets: Tensor  # [B, 2 * chunk]: the token after each one, from the whole row
    seq_len: int  # the rows' length before padding to a multiple of 2 * CP
    padded_len: int


def local_rows(input_ids: Tensor, group: Any = None) -> LocalRows:
    """Pad rows [B, S] to a multiple of 2 * CP * TP and keep this CP rank's two chunks
    (sequence parallelism splits each rank's chunks over TP; without it the few extra pad
    tokens change nothing)."""
    from megatron.core import parallel_state as ps

    group = group or cp_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    batch, seq = input_ids.shape
    padded_len = -(-seq // (2 * size * tp)) * (2 * size * tp)
    padded = input_ids.new_zeros((batch, padded_len))
    padded[:, :seq] = input_ids
    targets = torch.zeros_like(padded)
    targets[:, : seq - 1] = input_ids[:, 1:]  # the next token, also across chunk boundaries
    mine = chunk_positions(padded_len, size, rank, input_ids.device)
    positions = mine.unsqueeze(0).expand(batch, -1)
    return LocalRows(padded[:, mine], positions, targets[:, mine], seq, padded_len)


def gather_logprobs(local: Tensor, rows: LocalRows, group: Any = None) -> Tensor:
    """Whole-row log-probs [B, S] (0 at t = 0) from every CP rank's log-probs of its chunks'
    targets [B, 2 * chunk]; the backward keeps this rank's part."""
    group = group or cp_group()
    size = dist.get_world_size(group)
    gathered = gather_sequence(local, group, 1, reduce_grad=False)
    full = gathered[:, torch.argsort(gathered_positions(rows.padded_len, size, local.device))]
    out = torch.zeros((local.size(0), rows.seq_len), dtype=torch.float32, device=local.device)
    out[:, 1:] = full[:, : rows.seq_len - 1]
    return out


def logprobs_from_local_logits(
    logits: Tensor, rows: LocalRows, temperature: float = 1.0, group: Any = None
) -> Tensor:
    """Whole-row log-probs [B, S] from this CP rank's vocab-parallel logits of its chunks
    [B, 2 * chunk, V/TP] (every CP rank calls it: the result is all-gathered)."""
    from services.trainer.objective.chunked_logprobs import target_logprobs

    return gather_logprobs(target_logprobs(logits, rows.targets, temperature), rows, group)


def cp_token_logprobs(model: Any, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probs [B, S] of right-padded rows `input_ids` [B, S] under context parallelism:
    every CP rank passes the whole batch and gets the whole result (see the module doc)."""
    rows = local_rows(input_ids)
    logits = model(rows.input_ids, rows.position_ids, None)
    return logprobs_from_local_logits(logits, rows, temperature)
