"""The weight-update process group: a torch.distributed group apart from any default group.

Mirrors SGLang's `init_custom_process_group`: a TCP rendezvous at the trainer's master
address, a store prefixed by the group name, and a gloo or NCCL group built on it. The trainer
(rank 0) creates the same group with rank 0 and broadcasts each tensor from rank 0.
`rendezvous_store` is also the trainer's own process-group rendezvous (trainer/parallel.py).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch


def rendezvous_store(host: str, port: int, rank: int, world_size: int,
                     timeout: timedelta) -> Any:
    """The TCPStore of a rendezvous at host:port. Rank 0 serves it on `host` alone: torch's
    own tcp:// rendezvous would listen on every interface whatever the address says."""
    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(max(128, world_size))
        bound_port = listener.getsockname()[1]
        fd = listener.detach()  # the store owns the listening socket from here on
    try:
        return dist.TCPStore(host, bound_port, world_size, True, timeout,
                             master_listen_fd=fd, use_libuv=True)
    except BaseException:
        os.close(fd)
        raise


def split_init_method(init_method: str) -> tuple[str, int]:
    """Host and port of a `tcp://host:port` init method."""
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"init method {init_method!r}: expected tcp://host:port")
    return parts.hostname, parts.port


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
    )

    timeout = timedelta(seconds=timeout_s)
    store = rendezvous_store(*split_init_method(init_method), rank, world_size, timeout)
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
