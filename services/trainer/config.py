"""The [trainer] section of the deployment config: batches, loss, optimizer, checkpoints.

The model, parallelism and weight-sync sub-sections live in model_config.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from services.common.config import ServiceConfig, StrictModel
from services.trainer.model_config import ModelConfig, ParallelConfig, WeightSyncConfig

if TYPE_CHECKING:
    from services.trainer.objective.loss import LossSettings


class LossConfig(StrictModel):
    """The policy-gradient objective (see services/trainer/objective/loss.py)."""

    normalize_advantage_std: bool = Field(
        True, description="divide group-relative advantages by the group's reward std"
    )
    clip_eps_low: float = Field(0.2, ge=0, lt=1, description="PPO ratio clip below 1 - eps")
    clip_eps_high: float = Field(0.2, ge=0, description="PPO ratio clip above 1 + eps")
    tis_cap: float | None = Field(
        2.0, gt=0, description="truncate trainer/engine importance weights here (None: off)"
    )
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL penalty to the reference")
    reference_hf_path: str = Field(
        "", description="reference model folder for the KL term (empty: the initial weights)"
    )
    routing_replay: bool | None = Field(
        None, description="MoE models: route each token to the experts the engine routed it to "
        "(Trajectory.routed_experts; tokens without them route by themselves, counted). None: "
        "on for MoE models where the layout supports it (no pipeline or context parallelism)")

    def settings(self) -> LossSettings:
        from services.trainer.objective.loss import (
            LossSettings,  # torch stays out of config parsing
        )

        return LossSettings(self.clip_eps_low, self.clip_eps_high, self.tis_cap, self.kl_coef)


class OptimizerConfig(StrictModel):
    """Adam over fp32 master weights, in memory or streamed from local disk."""

    lr: float = Field(1e-6, gt=0, description="learning rate")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1")
    beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon")
    weight_decay: float = Field(0.0, ge=0, description="decoupled (AdamW) weight decay")
    max_grad_norm: float | None = Field(1.0, gt=0, description="gradient clipping (None: off)")
    stream_optimizer_state_to_disk: str | None = Field(
        None, description="keep master weights and moments in bucket files under this dir"
    )
    bucket_mb: float = Field(
        64.0, gt=0, description="fp32 master MiB per optimizer bucket (state is 3x that)"
    )
    state_on_device: bool = Field(
        True,
        description="keep fp32 master weights and moments where the parameters are (the GPU)"
        " and update them there; false keeps them in host RAM (hosts without GPU room). With"
        " stream_optimizer_state_to_disk each bucket passes through the parameters' device",
    )
    shard_state: bool = Field(
        True,
        description="split master weights and moments over data-parallel replicas, as "
        "megatron's distributed optimizer does (each updates its share, then broadcasts it)",
    )
    moments_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the stored Adam moments"
    )


class CheckpointConfig(StrictModel):
    """Where and how often the trainer checkpoints (and thereby acks the stream)."""

    dir: str = Field("checkpoints/trainer", min_length=1, description="checkpoint directory")
    interval_steps: int = Field(
        1, ge=1, description="checkpoint every k steps; stream entries are acked only then"
    )
    num_kept: int = Field(2, ge=1, description="newest checkpoints kept on disk")


class TrainerConfig(ServiceConfig):
    """Settings of the trainer service."""

    grpc_port: int = Field(50054, ge=0, le=65535, description="gRPC port (0 picks a free one)")
    admin_port: int = Field(8054, ge=0, le=65535, description="admin REST port (0: a free one)")
    rollout_batch_size: int = Field(8, ge=1, description="groups per trainer step")
    num_minibatches: int = Field(
        1, ge=1, description="optimizer updates per step (the batch is split into this many)"
    )
    max_tokens_per_microbatch: int = Field(
        8192, ge=1,
        description="tokens per forward/backward micro-batch (padded rows: counting the"
        " padding; a longer sample is a micro-batch of its own)",
    )
    packed_sequences: bool = Field(
        False,
        description="micro-batches of samples back to back in one row (THD, cu_seqlens),"
        " no padding computed; needs the fused or te attention backend and context_parallel"
        " = 1",
    )
    shared_prefix: bool = Field(
        False,
        description="score each group's shared prompt once per micro-batch: its samples'"
        " continuations attend to it in the same packed row (same log-probs and gradients,"
        " fewer tokens computed); needs packed_sequences, the fused attention backend and"
        " pipeline_parallel = 1",
    )
    max_steps: int = Field(0, ge=0, description="stop after this many steps (0: run until told)")
    max_staleness: int | None = Field(
        None, ge=0, le=1_000_000,
        description="a group generated more than this many weight versions before the one "
        "being trained is dropped (reason 'stale', recorded in the checkpoint) instead of "
        "trained; None: no limit. Set it to the rollout's max_staleness as a backstop",
    )
    consumer_name: str = Field(
        "trainer-0", min_length=1, description="this trainer's name in the consumer group"
    )
    read_block_ms: int = Field(
        1000, ge=1, description="longest single blocking stream read (stop is checked between)"
    )
    pad_token_id: int = Field(0, ge=0, description="token id used to right-pad rows")
    cpu_threads: int = Field(
        0, ge=0, le=1024,
        description="torch CPU threads of each rank (0: torch's default, one per core); on a "
        "machine it shares with engines, threads beyond the cores left to it only spin")
    host_mmap_threshold_mb: float | None = Field(
        1.0, gt=0, le=32,
        description="fix glibc malloc's mmap threshold at this many MiB in each rank, so freed "
        "host tensors go back to the OS (a CPU step of a 135M model in fp32 keeps 1 GiB less);"
        " None: glibc's adaptive threshold")
    sampling_temperature: float = Field(
        1.0, gt=0, description="the engines' sampling temperature: log-probs are of logits / T, "
        "as the engines report them (a deployment file sets it to rollout.scheduler.temperature "
        "unless given)"
    )
    loss: LossConfig = Field(default_factory=LossConfig, description="policy-gradient objective")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="optimizer")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="checkpoints"
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="model to train")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="parallelism")
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="pushing new weights to the engines"
    )

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.num_minibatches > self.rollout_batch_size:
            raise ValueError(
                f"num_minibatches ({self.num_minibatches}) exceeds rollout_batch_size "
                f"({self.rollout_batch_size}); lower it or raise the batch size"
            )
        if self.packed_sequences and self.model.attention_backend == "local":
            raise ValueError(
                "packed_sequences needs trainer.model.attention_backend = \"fused\" or \"te\""
                " (megatron's local attention has no packed mode)"
            )
        if self.packed_sequences and self.parallel.context_parallel > 1:
            raise ValueError(
                "packed_sequences does not run under context_parallel > 1 yet; turn one off"
            )
        if self.shared_prefix and not (
            self.packed_sequences and self.model.attention_backend == "fused"
            and self.parallel.pipeline_parallel == 1
        ):
            raise ValueError(
                "trainer.shared_prefix needs packed_sequences = true, model.attention_backend ="
                " \"fused\" and parallel.pipeline_parallel = 1; set those, or turn it off"
            )
        return self
