"""Micro-batches in lockstep across data-parallel ranks, for expert parallelism.

With expert parallelism every forward and backward of an MoE layer is a collective over the
expert-parallel group (expert TP is 1, so megatron draws it from the TP x CP x DP ranks of a
pipeline stage): each rank gathers the tokens of the others, and megatron's allgather
dispatcher needs the same number of tokens from each. The TP and CP ranks of one
data-parallel replica already run the same micro-batches with equal token counts (CP cuts a
row into equal chunks, sequence parallelism splits each evenly over TP, both after padding).
So every data-parallel rank must run as many micro-batches as the others, and the k-th of
each rank must have the same shape. `lockstep_share` deals the micro-batches round-robin like
plain data parallelism, pads each rank's k-th micro-batch to the largest shape among the
ranks' k-th (right and below, loss mask 0), and gives a rank that has none left a dummy of
that shape with no loss tokens. Padding changes no real token's log-prob (causal attention,
per-token routing without capacity limits) and adds no gradient (zero loss weight).
Used by step.DataShard.
"""

from __future__ import annotations

from torch import Tensor

from services.trainer.data.batch import MicroBatch

PAD_ID = 0


def pad_micro_batch(mb: MicroBatch, rows: int, width: int) -> MicroBatch:
    """`mb` right- and bottom-padded to `[rows, width]`; padded positions carry no loss."""
    num_rows, num_cols = mb.input_ids.shape
    if (num_rows, num_cols) == (rows, width):
        return mb
    if num_rows > rows or num_cols > width:
        raise ValueError(f"cannot pad a [{num_rows}, {num_cols}] micro-batch to [{rows}, {width}]")

    def grow(t: Tensor, fill: float) -> Tensor:
        out = t.new_full((rows, width), fill)
        out[:num_rows, :num_cols] = t
        return out

    return MicroBatch(
        input_ids=grow(mb.input_ids, PAD_ID),
        loss_mask=grow(mb.loss_mask, 0),
        rollout_logprobs=grow(mb.rollout_logprobs, 0),
        advantages=grow(mb.advantages, 0),
        lengths=list(mb.lengths) + [0] * (rows - num_rows),
        # a packed row's padding is one more (loss-free) sequence
        cu_seqlens=None if mb.cu_seqlens is None else (
            list(mb.cu_seqlens) + ([width] if width > num_cols else [])
        ),
        prefix_of=None if mb.prefix_of is None else (
            list(mb.prefix_of) + ([-1] if width > num_cols else [])
        ),
        routed_experts=None if mb.routed_experts is None else _grow_routes(
            mb.routed_experts, rows, width),
    )


def _grow_routes(routes: Tensor, rows: int, width: int) -> Tensor:
    """Routes padded like the tokens, -1 (route by itself) on the padding."""
    out = routes.new_full((rows, width, *routes.shape[2:]), -1)
    out[: routes.shape[0], : routes.shape[1]] = routes
    return out


def dummy_micro_batch(like: MicroBatch, rows: int, width: int) -> MicroBatch:
    """A micro-batch of padding only (no loss tokens), shaped `[rows, width]`."""
    empty = MicroBatch(
        input_ids=like.input_ids[:0, :0],
        loss_mask=like.loss_mask[:0, :0],
        rollout_logprobs=like.rollout_logprobs[:0, :0],
        advantages=like.advantages[:0, :0],
        lengths=[],
        cu_seqlens=None if like.cu_seqlens is None else [0],
        prefix_of=None if like.prefix_of is None else [],
    )
    return pad_micro_batch(empty, rows, width)


def lockstep_share(items: list[MicroBatch], rank: int, size: int) -> list[MicroBatch]:
    """This rank's micro-batches of `items` (every `size`-th from `rank`), as many and shaped
    like every other rank's: ceil(len(items) / size) of them, padded or dummy."""
    share = []
    for start in range(0, len(items), size):
        dealt = items[start : start + size]
        rows = max(mb.input_ids.shape[0] for mb in dealt)
        width = max(mb.input_ids.shape[1] for mb in dealt)
        if rank < len(dealt):
            share.append(pad_micro_batch(dealt[rank], rows, width))
        else:
            share.append(dummy_micro_batch(dealt[0], rows, width))
    return share
