"""Rank 0's end of the weight-update group: rendezvous, broadcast, teardown.

The group is SGLang's custom process group (services/common/weight_group.py, shared
with the built-in engine): the trainer is rank 0, the engines join at their rank offsets.
Used by weight_sync.py, which decides what to broadcast and tells the engines about it.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from services.common import weight_group
from services.common.errors import Unavailable
from services.common.ports import free_port
from services.trainer.model_config import WeightSyncConfig

Bucket = list[tuple[str, torch.Tensor]]


@dataclass
class Watch:
    """The engines' side of a collective: calls that fail when an engine refuses, and (for
    the rollout stream) a future that completes when the stream ends."""

    calls: list[Future[Any]] = field(default_factory=list)
    stream_end: Future[str] | None = None


def _fresh_group_name(prefix: str) -> str:
    # Unique per formation: a restarted trainer or an abandoned group never collides with
    # a group an engine or torch still holds under the old name.
    return f"{prefix}-{secrets.token_hex(4)}"


class TrainerEnd:
    """Rank 0's end of the weight-update group: rendezvous, broadcast, teardown.

    Collectives run on a worker thread while the caller watches the engines' side, so an
    engine that refuses a bucket fails the update at once instead of leaving rank 0 blocked
    in a broadcast nobody receives; such a group is abandoned and formed again next time."""

    def __init__(self, config: WeightSyncConfig, backend: str) -> None:
        self.config = config
        self.backend = backend
        self.port = config.master_port or free_port(config.master_address)
        self.group: Any = None
        self.group_name = _fresh_group_name(config.group_name)
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def join(self, world_size: int, watch: Watch) -> None:
        """Host the group as rank 0; returns once every engine rank has joined too."""
        self.leave()

        def rendezvous() -> None:
            self.group = weight_group.init_custom_process_group(
                backend=self.backend,
                init_method=f"tcp://{self.config.master_address}:{self.port}",
                world_size=world_size,
                rank=0,
                group_name=self.group_name,
                timeout_s=self.config.timeout_s,
            )

        self._run(rendezvous, watch)

    def broadcast(self, bucket: Bucket, watch: Watch) -> None:
        """Broadcast every tensor of `bucket` in order from rank 0."""

        def send() -> None:
            if self.device is not None:
                torch.cuda.set_device(self.device)  # the current device is per thread
            for _, tensor in bucket:
                dist.broadcast(tensor.contiguous(), src=0, group=self.group)

        self._run(send, watch)

    def _run(self, work: Callable[[], None], watch: Watch) -> None:
        """Run `work` on a worker thread; fail as soon as the engines' side fails."""
        mine: Future[None] = Future()

        def run() -> None:
            try:
                work()
                mine.set_result(None)
            except BaseException as exc:  # handed to the caller through the future
                mine.set_exception(exc)

        # A daemon thread: one stuck in an abandoned collective must not block process exit.
        threading.Thread(target=run, name="weight-sync", daemon=True).start()
        pending: set[Future[Any]] = {mine, *watch.calls}
        if watch.stream_end is not None:
            pending.add(watch.stream_end)
        while mine in pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done - {mine}:
                error = future.exception()
                if error is None and future is not watch.stream_end:
                    continue  # an engine call that finished: keep waiting for the collective
                self._abandon()
                raise error or Unavailable(f"the rollout service ended the weight update: "
                                           f"{future.result()}")
        mine.result()

    def _abandon(self) -> None:
        # The worker may stay blocked in the collective until its timeout: keep its group,
        # name and port out of the way and rendezvous afresh next time.
        self.group = None
        self.group_name = _fresh_group_name(self.config.group_name)
        self.port = self.config.master_port or free_port(self.config.master_address)

    def reset(self) -> None:
        """After a failed update: leave the group and rendezvous under a fresh name and
        port next time, so the engines' side forms the group again too."""
        try:
            self.leave()
        except Exception:  # a broken group may refuse to be destroyed: drop it anyway
            self.group = None
        self._abandon()

    def leave(self) -> None:
        if self.group is not None:
            weight_group.destroy_process_group(self.group)
            self.group = None
