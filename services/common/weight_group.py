"""The weight-update process group: a torch.distributed group apart from any default group.

Mirrors SGLang's `init_custom_process_group`: a TCP rendezvous at the trainer's master
address, a store prefixed by the group name, and a gloo or NCCL group built on it. The trainer
(rank 0) creates the same group with rank 0 and broadcasts each tensor from rank 0.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


def init_custom_process_group(
    *,
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 600.0,
) -> Any:
    """Join (or, as rank 0, host) a process group that does not touch the default group."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix_store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        prefix_store,
        group_name=group_name,  # type: ignore[arg-type]
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_process_group(group: Any) -> None:
    """Tear down a group made by `init_custom_process_group`."""
    import torch.distributed as dist

    dist.destroy_process_group(group)


def broadcast_tensor(tensor: torch.Tensor, group: Any) -> None:
    """Receive (or, on rank 0, send) one tensor in place by broadcast from rank 0."""
    import torch.distributed as dist

    dist.broadcast(tensor, src=0, group=group)
