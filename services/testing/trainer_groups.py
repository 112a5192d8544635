"""Scored groups for trainer tests: three samples each, deterministic per group index.

`scored_group(i)` is group `group-{i:03d}`: random response tokens seeded by `i`, every
response token in the loss, engine log-probs of -5, and reward 1 for sample i % 3 only, so
every group has non-zero reward variance.
"""

from __future__ import annotations

import torch

from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Group, Trajectory


def scored_group(index: int, *, vocab: int = 250, min_response_len: int = 4) -> Group:
    """Group `index` with responses of `min_response_len` + 0, 1, 2 tokens below `vocab`."""
    gen = torch.Generator().manual_seed(index)
    samples = []
    for i in range(3):
        response = torch.randint(3, vocab, (min_response_len + i,), generator=gen).tolist()
        samples.append(Trajectory(
            sample_id=f"s{index}-{i}", prompt_ids=[1, 2, 3 + index % 5], response_ids=response,
            loss_mask=[1] * len(response), rollout_logprobs=[-5.0] * len(response),
            reward=float(i == index % 3), status=VERDICT_STATUS_SCORED,
        ))  # fmt: skip
    return Group(group_id=f"group-{index:03d}", samples=samples)
