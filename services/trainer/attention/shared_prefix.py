"""Shared-prefix rows: a group's common prompt scored once for all of its samples.

The samples of a group start with the same prompt (system prompt and task), which is most of
a short agent episode's tokens. With `trainer.shared_prefix`, a packed micro-batch holds that
prompt once, as a sequence of its own, and each sample's continuation as a sequence that
attends to the prompt and then causally to itself, its RoPE positions going on from the
prompt's: each sample's log-probs and gradients are those of the sample run whole, and the
prompt's tokens are computed once a micro-batch instead of once a sample.

A packed row's layout is its boundaries `cu_seqlens` plus `prefix_of`: for each sequence, the
index of the earlier sequence of the row that it continues (-1: none; a prefix continues
nothing). The shared part stops one token short of where the samples' ids diverge or a loss
token starts, so every continuation begins with a loss-free token: no log-prob is ever taken
from a prefix's last position. megatron hands its attention and RoPE nothing of a packed row
but the boundaries tensor, so the layout travels on that tensor (`tag`, `layout_of`).
Used by batch.py (building rows), logprobs.py, rope.py and fused_attention.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

#: For each sequence of a packed row, the earlier sequence it continues (-1: none).
PrefixOf = Sequence[int]
_LAYOUT_ATTR = "riptide_prefix_of"


def shareable_len(ids: Sequence[Sequence[int]], masks: Sequence[Sequence[int]]) -> int:
    """How many leading tokens rows with these ids and loss masks can share: their common
    loss-free prefix less its last token, which each continuation keeps as its first; 0 when
    fewer than two rows or nothing to share."""
    if len(ids) < 2:
        return 0
    first = ids[0]
    limit = min(len(row) for row in ids)
    common = 0
    while common < limit and all(
        row[common] == first[common] and mask[common] == 0 for row, mask in zip(ids, masks,
                                                                                 strict=True)
    ):
        common += 1
    return max(common - 1, 0)


def check_layout(bounds: Sequence[int], prefix_of: PrefixOf) -> None:
    """Raise ValueError unless every sequence continues nothing or an earlier sequence that
    itself continues nothing."""
    if len(prefix_of) != len(bounds) - 1:
        raise ValueError(f"prefix_of names {len(prefix_of)} sequences, the row has "
                         f"{len(bounds) - 1}")
    for i, parent in enumerate(prefix_of):
        if parent >= i or (parent >= 0 and prefix_of[parent] >= 0):
            raise ValueError(f"sequence {i} continues {parent}: a prefix must be an earlier "
                             "sequence that continues nothing")


def positions(bounds: Sequence[int], prefix_of: PrefixOf) -> Tensor:
    """Each token's RoPE position [T] (int64): its offset in its sequence, plus the length of
    the prefix that sequence continues."""
    starts = torch.tensor(bounds[:-1], dtype=torch.long)
    lengths = torch.tensor(bounds[1:], dtype=torch.long) - starts
    shift = torch.tensor([0 if p < 0 else bounds[p + 1] - bounds[p] for p in prefix_of],
                         dtype=torch.long)  # fmt: skip
    tokens = torch.arange(bounds[-1] - bounds[0], dtype=torch.long) + bounds[0]
    return tokens - (starts - shift).repeat_interleave(lengths)


def longest_context(bounds: Sequence[int], prefix_of: PrefixOf) -> int:
    """The longest context a sequence attends to: its own length plus its prefix's."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return max(n + (lengths[p] if p >= 0 else 0) for n, p in zip(lengths, prefix_of,
                                                                 strict=True))


def tag(cu_seqlens: Tensor, prefix_of: PrefixOf) -> Tensor:
    """`cu_seqlens` carrying the row's `prefix_of` for the attention and RoPE to read."""
    setattr(cu_seqlens, _LAYOUT_ATTR, tuple(int(p) for p in prefix_of))
    return cu_seqlens


def layout_of(cu_seqlens: Tensor | None) -> tuple[int, ...] | None:
    """The `prefix_of` that `tag` put on `cu_seqlens`; None for a row without shared prefixes."""
    return getattr(cu_seqlens, _LAYOUT_ATTR, None)
