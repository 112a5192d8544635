"""Start and stop the trainer's ranks: torch.distributed plus megatron's parallel_state.

One call per process sets up the default process group (NCCL with CUDA, gloo on the CPU),
megatron's TP/PP/CP/EP/DP groups and its model-parallel RNG, after shimming megatron-core for
the CPU when there is no GPU. Rank, world size and rendezvous come from the arguments or from
the usual torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.common.errors import ConfigError
from services.common.weight_group import rendezvous_store
from services.trainer.model_config import ParallelConfig
from services.trainer.parallel.cpu_shim import apply_cpu_shim


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the parallel layout."""

    rank: int
    world_size: int
    backend: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_size: int
    ep_rank: int
    ep_size: int
    dp_rank: int
    dp_size: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def resolve_backend(config: ParallelConfig) -> str:
    """The collective backend: the configured one, or nccl when CUDA is present, else gloo."""
    if config.backend != "auto":
        return config.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_sizes(config: ParallelConfig, world_size: int) -> int:
    """The DP size of `world_size` ranks in `config`'s layout; raises ConfigError, naming the
    fields, for layouts megatron cannot build. Expert TP is 1, so megatron draws EP from the
    TP x CP x DP ranks of each pipeline stage."""
    if world_size % config.model_parallel_size:
        raise ConfigError(
            f"world size {world_size} is not divisible by TP*PP*CP = {config.model_parallel_size};"
            " change the parallel sizes or the number of trainer ranks"
        )
    dp_size = world_size // config.model_parallel_size
    if config.data_parallel is not None and config.data_parallel != dp_size:
        raise ConfigError(
            f"data_parallel={config.data_parallel} but world size {world_size} / TP*PP*CP gives"
            f" {dp_size}; leave data_parallel unset or launch {config.data_parallel} x"
            f" {config.model_parallel_size} ranks"
        )
    tp, cp, ep = config.tensor_parallel, config.context_parallel, config.expert_parallel
    if (tp * cp * dp_size) % ep:
        raise ConfigError(
            f"expert_parallel={ep} must divide tensor_parallel x context_parallel x"
            f" data_parallel = {tp} x {cp} x {dp_size} (expert TP is 1, so EP takes its ranks"
            " from those); change expert_parallel or data_parallel"
        )
    if config.sequence_parallel and tp == 1:
        raise ConfigError("sequence_parallel needs tensor_parallel > 1; turn it off or raise"
                          " tensor_parallel")
    if ep > 1 and tp > 1 and not config.sequence_parallel:
        raise ConfigError(
            f"expert_parallel={ep} with tensor_parallel={tp} needs sequence_parallel = true"
            " (megatron-core trains MoE layers under TP only with sequence parallelism)"
        )
    return dp_size


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init_parallel(
    config: ParallelConfig,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    local_rank: int | None = None,
    seed: int = 1234,
) -> ParallelLayout:
    """Initialise torch.distributed and megatron's parallel groups for this process."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    check_sizes(config, world_size)
    backend = resolve_backend(config)
    apply_cpu_shim()
    if backend == "nccl":
        if local_rank is None:
            local_rank = _env_int("LOCAL_RANK", rank % torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = master_port or _env_int("MASTER_PORT", 29500)
        timeout = timedelta(seconds=config.init_timeout_s)
        store = rendezvous_store(addr, port, rank, world_size, timeout)  # on addr alone
        dist.init_process_group(backend=backend, store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_parallel,
        pipeline_model_parallel_size=config.pipeline_parallel,
        context_parallel_size=config.context_parallel,
        expert_model_parallel_size=config.expert_parallel,
        expert_tensor_parallel_size=1,  # as model.transformer_config and the converters assume
        distributed_timeout_minutes=max(1, int(config.init_timeout_s // 60)),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> ParallelLayout:
    """The layout of this process after `init_parallel`."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        cp_size=ps.get_context_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )


def teardown_parallel() -> None:
    """Destroy megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
