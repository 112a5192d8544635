"""Packing groups into training tensors: alignment, masks, advantages, micro-batches."""

from __future__ import annotations

import torch

from services._proto.riptide.v1.common_pb2 import (
    VERDICT_STATUS_NO_VERDICT,
    VERDICT_STATUS_SCORED,
    Group,
    Trajectory,
)
from services.trainer.data.batch import pack_groups


def _sample(prompt: list[int], response: list[int], mask: list[int], reward: float,
            status: int = VERDICT_STATUS_SCORED) -> Trajectory:
    return Trajectory(prompt_ids=prompt, response_ids=response, loss_mask=mask, reward=reward,
                      rollout_logprobs=[-0.5 * (i + 1) for i in range(len(response))],
                      status=status)


def test_pack_aligns_tokens_masks_logprobs_and_advantages() -> None:
    group = Group(group_id="g1", min_weight_version=3, samples=[
        _sample([1, 2], [3, 4, 5], [1, 0, 1], reward=1.0),
        _sample([1, 2, 9], [6], [1], reward=0.0),
        _sample([7], [8], [1], reward=5.0, status=VERDICT_STATUS_NO_VERDICT),
    ])  # fmt: skip
    batch = pack_groups([("1-0", group)], normalize_std=False, max_tokens_per_microbatch=100,
                        pad_id=0)
    assert batch.entry_ids == ["1-0"] and batch.group_ids == ["g1"]
    assert batch.num_samples == 2 and batch.num_dropped_samples == 1
    assert batch.rewards == [1.0, 0.0] and batch.min_weight_versions == [3]
    (mb,) = batch.micro_batches
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 9, 6, 0]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 0, 1], [0, 0, 0, 1, 0]]
    assert mb.rollout_logprobs.tolist() == [[0, 0, -0.5, -1.0, -1.5], [0, 0, 0, -0.5, 0]]
    assert mb.advantages[0, 2].item() == 0.5 and mb.advantages[1, 3].item() == -0.5
    assert mb.lengths == [5, 4] and batch.num_tokens == 9 and batch.num_loss_tokens == 3


def test_micro_batches_respect_the_token_budget() -> None:
    samples = [_sample([1] * n, [2, 2], [1, 1], reward=float(n)) for n in (1, 6, 3, 2)]
    batch = pack_groups([("1-0", Group(group_id="g", samples=samples))], True, 9)
    widths = [tuple(mb.input_ids.shape) for mb in batch.micro_batches]
    assert widths == [(1, 8), (1, 5), (2, 4)]  # longest first, rows * width <= 9
    assert all(r * w <= 9 for r, w in widths)
    total_adv = sum((mb.advantages * mb.loss_mask).sum() for mb in batch.micro_batches)
    assert torch.isclose(total_adv, torch.tensor(0.0), atol=1e-5)  # centred per group


def test_segments_of_an_episode_train_as_rows_of_its_one_advantage() -> None:
    from services._proto.riptide.v1.common_pb2 import TrajectorySegment

    rewritten = _sample([1, 2], [3, 4], [1, 1], reward=1.0)
    rewritten.segments.append(TrajectorySegment(
        prompt_ids=[1, 9], response_ids=[5, 6], loss_mask=[0, 1], rollout_logprobs=[0.0, -0.2],
        weight_versions=[-1, 3], cause="history_rewritten"))
    group = Group(group_id="g", samples=[rewritten, _sample([1, 2], [7], [1], reward=0.0)])
    batch = pack_groups([("1-0", group)], normalize_std=False, max_tokens_per_microbatch=100)
    assert batch.num_samples == 2 and batch.rewards == [1.0, 0.0]  # the baseline: 2 episodes
    (mb,) = batch.micro_batches
    rows = {tuple(r[:4]) for r in mb.input_ids.tolist()}
    assert rows == {(1, 2, 3, 4), (1, 9, 5, 6), (1, 2, 7, 0)}
    segment_row = [i for i in range(3) if mb.input_ids[i, :2].tolist() == [1, 9]][0]
    assert mb.advantages[segment_row, 3].item() == 0.5  # the episode's advantage, not its own
    assert mb.loss_mask[segment_row].tolist()[:4] == [0, 0, 0, 1]
    with_segment = [i for i in range(3) if mb.input_ids[i, :4].tolist() == [1, 2, 3, 4]][0]
    assert mb.advantages[with_segment, 2].item() == 0.5
