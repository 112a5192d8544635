"""Optimizer state split over data-parallel replicas, as megatron's distributed optimizer does.

Replicas of a parameter (data-parallel ranks, and context-parallel ranks, which hold the same
weights) all compute the same Adam update from the same all-reduced gradient, so each needs
only part of the optimizer state. With a `StateShard`, `MasterAdam` keeps the fp32 master and
both moments of the buckets it owns (bucket i belongs to replica i mod size), updates only
those, and then every bucket's new parameter values are broadcast from their owner to the
other replicas: optimizer-state memory (in RAM or in the disk-streamed files) drops to about
1/size per rank, and the parameters stay bit-identical to an unsharded update.

Dense and expert parameters are replicated over different groups (DP x CP and the expert-DP
group), so a model with expert parallelism gets one MasterAdam each, joined by
`CombinedOptimizer`. Built by megatron_policy.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from services.trainer.optim.optimizer_stream import Bucket, MasterAdam, Slice


@dataclass(frozen=True)
class StateShard:
    """This rank's place among the replicas that split one optimizer's state."""

    rank: int
    size: int
    group: Any  # the process group of the replicas

    def owns(self, bucket_index: int) -> bool:
        return bucket_index % self.size == self.rank

    def share(self, buckets: Sequence[Bucket], param_slice: Callable[[Slice], Tensor]) -> None:
        """Broadcast each bucket's parameter values from the replica that updated them."""
        for bucket in buckets:
            pieces = [param_slice(s) for s in bucket.slices]
            if not pieces:
                continue
            owner = bucket.index % self.size
            if owner == self.rank:
                flat = torch.cat(pieces)
            else:
                flat = torch.empty(bucket.numel, dtype=pieces[0].dtype, device=pieces[0].device)
            dist.broadcast(flat, src=dist.get_global_rank(self.group, owner), group=self.group)
            if owner != self.rank:
                offset = 0
                for piece in pieces:
                    piece.copy_(flat[offset : offset + piece.numel()])
                    offset += piece.numel()


def state_shard(group: Any) -> StateShard | None:
    """The shard of this rank in `group`, or None when the group has one member."""
    size = dist.get_world_size(group=group)
    return StateShard(dist.get_rank(group=group), size, group) if size > 1 else None


class CombinedOptimizer:
    """Several MasterAdams (dense and expert parameters) that step, save and load as one."""

    def __init__(self, parts: dict[str, MasterAdam]) -> None:
        self.parts = parts
        self.params = [p for part in parts.values() for p in part.params]

    def zero_grad(self) -> None:
        for part in self.parts.values():
            part.zero_grad()

    def step(self) -> None:
        for part in self.parts.values():
            part.step()

    def state_nbytes(self) -> int:
        return sum(part.state_nbytes() for part in self.parts.values())

    def save(self, directory: Path) -> None:
        for name, part in self.parts.items():
            (directory / name).mkdir()
            part.save(directory / name)

    def load(self, directory: Path) -> None:
        for name, part in self.parts.items():
            part.load(directory / name)

    def close(self) -> None:
        for part in self.parts.values():
            part.close()
