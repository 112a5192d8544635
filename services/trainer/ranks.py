"""The trainer's ranks beyond the first: launch, command channel, sharded checkpoints.

Rank 0 is the trainer service: it serves gRPC/admin, reads the stream and runs the loop.
With more than one rank (TP x PP x CP x DP) it starts the other ranks as child processes
(worker.py) that die with it, and drives them with commands broadcast over a dedicated gloo
group (long timeout: the workers may wait as long as the stream stays empty): train a step on
these micro-batches, save or load a checkpoint shard, take part in a weight sync's gathers, stop.
Every rank holds its own model and optimizer shard; checkpoints keep one `rank-NNNNN`
folder per rank inside the same atomic step directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from services.common import process
from services.trainer.config import TrainerConfig
from services.trainer.data.batch import MicroBatch
from services.trainer.model.policy import ModelPolicy
from services.trainer.parallel.parallel import check_sizes

_CONTROL_TIMEOUT = timedelta(days=365)


@dataclass
class Step:
    """Train one rollout batch (every rank gets the same micro-batches)."""

    micro_batches: list[MicroBatch]


@dataclass
class Save:
    """Write this rank's shard into the (temporary) checkpoint directory."""

    directory: str


@dataclass
class Load:
    """Restore this rank's shard from a checkpoint directory."""

    directory: str


@dataclass
class Sync:
    """Take part in the gathers of a weight sync."""

    weight_version: int


@dataclass
class Stop:
    """Leave the command loop and exit (after a barrier, so rank 0 outlives the delivery)."""


Command = Step | Save | Load | Sync | Stop


def service_world_size(config: TrainerConfig) -> int:
    """Ranks the trainer service runs; raises ConfigError for layouts it cannot train yet."""
    p = config.parallel
    world_size = p.model_parallel_size * (p.data_parallel or 1)
    check_sizes(p, world_size)
    return world_size


def shard_dir(directory: str | Path, rank: int) -> Path:
    """The folder of one rank's shard inside a checkpoint directory."""
    return Path(directory) / f"rank-{rank:05d}"


class ControlChannel:
    """Commands from rank 0 to every rank, over a gloo group of the whole world.

    Created by every rank, at the same point of start-up (it is a collective)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
        self.rank = dist.get_rank()

    def send(self, command: Command) -> None:
        """Rank 0: broadcast `command` to the other ranks."""
        dist.broadcast_object_list([command], src=0, group=self.group)

    def receive(self) -> Command:
        """Other ranks: the next command from rank 0 (waits as long as it takes)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]  # type: ignore[no-any-return]

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def save_shard(policy: ModelPolicy, directory: str | Path, rank: int) -> None:
    path = shard_dir(directory, rank)
    path.mkdir()
    policy.save(path)


class RankedPolicy:
    """Rank 0's policy: computes like the wrapped one; checkpoint I/O runs on every rank."""

    def __init__(self, inner: ModelPolicy, channel: ControlChannel) -> None:
        self.inner = inner
        self.channel = channel
        self.model = inner.model
        self.temperature = inner.temperature
        self.logprobs = inner.logprobs
        self.backward = inner.backward
        self.step = inner.step

    def save(self, directory: Path) -> None:
        self.channel.send(Save(str(directory)))
        save_shard(self.inner, directory, 0)
        self.channel.barrier()  # every shard is written before the checkpoint is committed

    def load(self, directory: Path) -> None:
        self.channel.send(Load(str(directory)))
        self.inner.load(shard_dir(directory, 0))
        self.channel.barrier()


def launch_workers(
    config: TrainerConfig, world_size: int, master_port: int
) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1..world_size-1 (worker.py); they die with this process. Their config
    and logs go to `<checkpoint dir>/ranks/`."""
    folder = Path(config.checkpoint.dir) / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "trainer-config.json"
    config_path.write_text(json.dumps(config.model_dump(mode="json")))
    return [
        process.spawn(
            [sys.executable, "-m", "services.trainer.worker", "--config", str(config_path),
             "--rank", str(rank), "--world-size", str(world_size),
             "--master-port", str(master_port)],
            log_path=folder / f"rank-{rank:05d}.log",
        )  # fmt: skip
        for rank in range(1, world_size)
    ]


def join_workers(workers: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    """Wait for the workers to leave (after Stop), then stop whatever is left."""
    for worker in workers:
        try:
            worker.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        process.stop(worker, grace_s=5.0)
