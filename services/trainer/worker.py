"""A trainer rank other than 0: builds its shard of the policy and follows rank 0's commands.

Started by the trainer service (ranks.launch_workers) as
`python -m services.trainer.worker --config FILE --rank R --world-size W --master-port P`,
where FILE is the trainer section as JSON, or, with `parallel.launcher = "external"`, by
`riptide serve trainer` on a rank other than 0 that srun or torchrun started (rank_env.py).
It runs the same step, checkpoint and weight-sync code as rank 0 on its own shard, and exits
when rank 0 sends Stop or when rank 0 is gone (its collectives then fail).
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

from services.trainer.config import TrainerConfig
from services.trainer.megatron_policy import RankAddress
from services.trainer.parallel.rank_env import LaunchedRank

log = logging.getLogger("services.trainer.worker")


def run_worker(config: TrainerConfig, address: RankAddress) -> None:
    """Build this rank's policy, then execute commands until Stop."""
    import torch

    from services.trainer.data.batch import RolloutBatch
    from services.trainer.megatron_policy import build_policy
    from services.trainer.pipeline_step import train_step_for
    from services.trainer.ranks import (
        ControlChannel,
        Load,
        Save,
        Step,
        Stop,
        Sync,
        save_shard,
        shard_dir,
    )
    from services.trainer.weights.convert import iter_hf_buckets

    rank, world_size = address.rank, address.world_size
    built = build_policy(config, address)
    channel = ControlChannel()
    settings = config.loss.settings()
    train_step = train_step_for(config.parallel)
    sync_dtype = getattr(torch, config.weight_sync.dtype)
    log.info("rank %d of %d ready", rank, world_size)
    while True:
        command = channel.receive()
        if isinstance(command, Step):
            batch = RolloutBatch(command.micro_batches, [], [], []).on_device(built.device)
            train_step(built.policy, batch, settings, config.num_minibatches, built.reference,
                       built.shard)
        elif isinstance(command, Save):
            save_shard(built.policy, command.directory, rank)
            channel.barrier()
        elif isinstance(command, Load):
            built.policy.load(shard_dir(command.directory, rank))
            channel.barrier()
        elif isinstance(command, Sync):
            # Rank 0 sends; the others take part in the same gathers (see weight_sync.py).
            for _ in iter_hf_buckets(built.model, built.shape, config.weight_sync.bucket_size_mb,
                                     sync_dtype):
                pass
        elif isinstance(command, Stop):
            log.info("rank %d stopping", rank)
            channel.barrier()  # rank 0 leaves only once every rank has the Stop
            return
        else:
            raise TypeError(f"unknown command {command!r}")


def serve_launched_rank(config: TrainerConfig, me: LaunchedRank) -> None:
    """`riptide serve trainer` on a rank other than 0 that srun or torchrun started."""
    # A cancelled job signals every rank at once: this one must stay for the final checkpoint
    # rank 0 writes with it, and leaves on rank 0's Stop or when rank 0 is gone.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log.info("rank %d of %d joins rank 0 at %s:%d", me.rank, me.world_size, me.master_addr,
             me.master_port)
    run_worker(config, RankAddress(me.rank, me.world_size, me.master_addr, me.master_port,
                                   me.local_rank))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a trainer rank other than 0")
    parser.add_argument("--config", required=True, help="the trainer section as JSON")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = TrainerConfig.model_validate_json(Path(args.config).read_text())
    run_worker(config, RankAddress(args.rank, args.world_size, args.master_addr,
                                   args.master_port))


if __name__ == "__main__":
    main()
