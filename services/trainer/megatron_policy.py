"""Build the trainer's policy from config: the megatron GPT model from a Hugging Face folder.

Sets up the ranks (parallel.py), builds the model (model.py: the configured attention backend
and recomputation), loads the Hugging Face weights (convert.py) and wraps it in a
`ModelPolicy` with per-token log-probs from logprobs.py at the engines' sampling temperature
(`trainer.sampling_temperature`) and `MasterAdam` (optimizer state on the parameters' device by
default, in host RAM, or streamed from `stream_optimizer_state_to_disk`);
under context parallelism the log-probs come from context_parallel.py.
Called by service.py; tests call it for the real-model paths.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError
from services.trainer.config import TrainerConfig
from services.trainer.model.policy import FrozenModel, ModelPolicy
from services.trainer.model_config import ParallelConfig
from services.trainer.optim.optimizer_shard import CombinedOptimizer
from services.trainer.optim.optimizer_stream import MasterAdam, megatron_no_decay

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankAddress:
    """This process's rank in a world of trainer ranks and where they meet."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int | None = None  # the GPU on its node (None: rank modulo the GPU count)


@dataclass
class BuiltPolicy:
    """The policy and what weight sync needs alongside it."""

    policy: ModelPolicy
    reference: FrozenModel | None
    model: Any
    shape: Any
    layout: Any
    backend: str
    shard: Any = None  # this rank's DataShard under data parallelism (None: DP = 1)

    @property
    def device(self) -> Any:
        """Where this rank's parameters live (a CUDA device, or the CPU)."""
        return next(self.model.parameters()).device


def check_moe_layout(shape: Any, parallel: ParallelConfig) -> None:
    """Raise ConfigError where megatron-core cannot train `shape` (a model.ModelShape) in the
    `parallel` layout: its MoE layer trains under TP only with sequence parallelism."""
    if shape.is_moe and parallel.tensor_parallel > 1 and not parallel.sequence_parallel:
        raise ConfigError(
            f"MoE models with tensor_parallel={parallel.tensor_parallel} need"
            " trainer.parallel.sequence_parallel = true (megatron-core trains MoE layers under"
            " TP only with sequence parallelism); turn it on, or set tensor_parallel = 1"
        )


def build_model(
    config: TrainerConfig, ranks: RankAddress | None = None
) -> tuple[Any, Any, Any, str]:
    """(model, shape, layout, backend) of this rank, weights loaded from `model.hf_path`.

    `ranks` places this process in a multi-rank world; without it the torchrun environment
    (RANK, WORLD_SIZE, ...) does, or a world of one."""
    from services.common.ports import free_port
    from services.trainer.model.model import ModelShape, load_hf_config
    from services.trainer.parallel.parallel import init_parallel, resolve_backend
    from services.trainer.weights.convert import load_hf_checkpoint

    if not config.model.hf_path:
        raise ConfigError("trainer.model.hf_path is empty; point it at a Hugging Face folder")
    if ranks is not None:
        layout = init_parallel(
            config.parallel, rank=ranks.rank, world_size=ranks.world_size,
            master_addr=ranks.master_addr, master_port=ranks.master_port,
            local_rank=ranks.local_rank, seed=config.model.seed,
        )  # fmt: skip
    else:
        single = "WORLD_SIZE" not in os.environ
        layout = init_parallel(
            config.parallel,
            master_port=free_port() if single else None,
            seed=config.model.seed,
        )
    shape = ModelShape.from_hf(load_hf_config(config.model.hf_path))
    check_moe_layout(shape, config.parallel)
    model = configured_model(config, shape)
    load_hf_checkpoint(model, shape, config.model.hf_path)
    return model, shape, layout, resolve_backend(config.parallel)


def configured_model(config: TrainerConfig, shape: Any) -> Any:
    """model.build_gpt_model for `shape` with the configured dtype, layout, attention backend
    and activation recomputation, its layers compiled as `compile_layers` says."""
    from services.trainer.model.layer_compile import compile_layers, should_compile
    from services.trainer.model.model import build_gpt_model

    model = build_gpt_model(
        shape, dtype=config.model.dtype, num_layers_per_stage=config.parallel.num_layers_per_stage,
        sequence_parallel=config.parallel.sequence_parallel,
        attention=config.model.attention_backend, recompute=config.model.recompute(),
        grouped_experts=config.model.grouped_experts,
    )  # fmt: skip
    if should_compile(config.model.compile_layers, model):
        compile_layers(model)
    return model


def build_optimizer(
    config: TrainerConfig, named: list[tuple[str, Any]], state_dir: str | None, distributed: bool
) -> MasterAdam | CombinedOptimizer:
    """MasterAdam over `named` parameters; with `optimizer.shard_state` and replicas, dense
    parameters split their state over DP x CP and expert parameters over the expert-DP group."""
    import torch

    opt = config.optimizer

    def adam(part: list[tuple[str, Any]], folder: str | None, shard: Any) -> MasterAdam:
        return MasterAdam(
            [p for _, p in part], lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
            weight_decay=opt.weight_decay, state_dir=folder, bucket_mb=opt.bucket_mb,
            moments_dtype=getattr(torch, opt.moments_dtype), no_decay=megatron_no_decay(part),
            shard=shard, device=None if opt.state_on_device else torch.device("cpu"),
        )  # fmt: skip

    if not (distributed and opt.shard_state):
        return adam(named, state_dir, None)
    from megatron.core import parallel_state as ps

    from services.trainer.optim.grad_norm import is_expert_param
    from services.trainer.optim.optimizer_shard import state_shard

    dense = [(n, p) for n, p in named if not is_expert_param(p)]
    expert = [(n, p) for n, p in named if is_expert_param(p)]
    dense_shard = state_shard(ps.get_data_parallel_group(with_context_parallel=True))
    if not expert:
        return adam(dense, state_dir, dense_shard)
    sub = (lambda name: str(Path(state_dir) / name)) if state_dir else (lambda name: None)
    return CombinedOptimizer({
        "dense": adam(dense, sub("dense"), dense_shard),
        "expert": adam(expert, sub("expert"), state_shard(ps.get_expert_data_parallel_group())),
    })  # fmt: skip


def routing_replay(config: TrainerConfig, shape: Any, layout: Any, model: Any) -> Any:
    """The model's RoutingReplay when `trainer.loss.routing_replay` asks for it (None: on for
    MoE models where the layout supports it), else None."""
    wanted = config.loss.routing_replay
    if not shape.is_moe or wanted is False:
        if wanted and not shape.is_moe:
            raise ConfigError("trainer.loss.routing_replay = true needs an MoE model")
        return None
    unsupported = [name for name, size in (("pipeline", layout.pp_size),
                                           ("context", layout.cp_size)) if size > 1]
    if unsupported:
        message = (f"routing replay is not supported with {' or '.join(unsupported)} "
                   "parallelism")
        if wanted:
            raise ConfigError(f"trainer.loss.routing_replay = true: {message}; set it to false")
        log.warning("%s: MoE layers route by themselves", message)
        return None
    from services.trainer.model.routing_replay import RoutingReplay

    return RoutingReplay(model, shape)


def build_policy(config: TrainerConfig, ranks: RankAddress | None = None) -> BuiltPolicy:
    """The megatron policy with its optimizer, as configured."""

    from services.trainer.objective.logprobs import token_logprobs
    from services.trainer.optim.grad_norm import (
        all_reduce_data_parallel_grads,
        clip_model_parallel_grad_norm,
    )

    if config.cpu_threads:
        import torch

        torch.set_num_threads(config.cpu_threads)
    if config.host_mmap_threshold_mb is not None:
        from services.trainer.optim.host_malloc import fix_mmap_threshold

        fix_mmap_threshold(int(config.host_mmap_threshold_mb * 2**20))
    model, shape, layout, backend = build_model(config, ranks)
    opt = config.optimizer
    state_dir = opt.stream_optimizer_state_to_disk
    if state_dir is not None and layout.world_size > 1:
        state_dir = str(Path(state_dir) / f"rank{layout.rank:05d}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(config, named, state_dir, layout.world_size > 1)
    clip = clip_model_parallel_grad_norm if layout.world_size > 1 else None
    grad_sync = all_reduce_data_parallel_grads if layout.world_size > 1 else None
    logprob_fn: Any = token_logprobs  # cp_token_logprobs under CP (no packed rows there)
    if config.model.fused_output_logprobs != "auto":
        fused = config.model.fused_output_logprobs == "on"
        logprob_fn = functools.partial(token_logprobs, fused=fused)
    loss_tokens_only = layout.cp_size == 1  # token_logprobs scores only the loss tokens
    if layout.cp_size > 1:
        from services.trainer.attention.context_parallel import cp_token_logprobs

        logprob_fn = cp_token_logprobs
    temperature = config.sampling_temperature
    policy = ModelPolicy(model, optimizer, logprob_fn, opt.max_grad_norm, clip, grad_sync,
                         temperature, routing_replay(config, shape, layout, model),
                         loss_tokens_only)  # fmt: skip
    reference = None
    if config.loss.kl_coef > 0:
        from services.trainer.weights.convert import load_hf_checkpoint

        ref_model = configured_model(config, shape)
        load_hf_checkpoint(ref_model, shape, config.loss.reference_hf_path or config.model.hf_path)
        reference = FrozenModel(ref_model, logprob_fn, temperature, loss_tokens_only)
    shard = None
    if layout.dp_size > 1:
        from megatron.core import parallel_state as ps

        from services.trainer.step import DataShard

        shard = DataShard(layout.dp_rank, layout.dp_size, ps.get_data_parallel_group(),
                          lockstep=layout.ep_size > 1)
    return BuiltPolicy(policy, reference, model, shape, layout, backend, shard)
