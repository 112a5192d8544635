"""Lockstep shares for expert parallelism: every rank gets as many micro-batches as the others,
the k-th of each the same shape, real data kept and padding free of loss tokens."""

from __future__ import annotations

import torch

from services.trainer.data.batch import MicroBatch
from services.trainer.data.lockstep import lockstep_share, pad_micro_batch


def _mb(rows: int, width: int, seed: int) -> MicroBatch:
    gen = torch.Generator().manual_seed(seed)
    return MicroBatch(
        input_ids=torch.randint(1, 50, (rows, width), generator=gen),
        loss_mask=torch.ones(rows, width),
        rollout_logprobs=-torch.rand(rows, width, generator=gen),
        advantages=torch.randn(rows, width, generator=gen),
        lengths=[width] * rows,
    )


def test_ranks_get_equal_counts_and_shapes() -> None:
    items = [_mb(1, 9, 0), _mb(2, 7, 1), _mb(3, 5, 2), _mb(1, 4, 3), _mb(2, 3, 4)]
    shares = [lockstep_share(items, rank, 3) for rank in range(3)]
    assert [len(s) for s in shares] == [2, 2, 2]
    for k in range(2):
        shapes = {tuple(s[k].input_ids.shape) for s in shares}
        assert len(shapes) == 1, (k, shapes)
    assert tuple(shares[0][0].input_ids.shape) == (3, 9)
    assert tuple(shares[2][1].input_ids.shape) == (2, 4)
    assert shares[2][1].num_loss_tokens == 0  # a dummy: rank 2 has no 6th micro-batch
    assert torch.equal(shares[1][1].input_ids[:2, :3], items[4].input_ids)  # round-robin
    total = sum(mb.num_loss_tokens for share in shares for mb in share)
    assert total == sum(mb.num_loss_tokens for mb in items)


def test_padding_keeps_real_tokens_and_adds_no_loss() -> None:
    mb = _mb(2, 5, 7)
    padded = pad_micro_batch(mb, 3, 8)
    assert torch.equal(padded.input_ids[:2, :5], mb.input_ids)
    assert torch.equal(padded.advantages[:2, :5], mb.advantages)
    assert padded.num_loss_tokens == mb.num_loss_tokens
    assert padded.lengths == [5, 5, 0]
    assert pad_micro_batch(mb, 2, 5) is mb
