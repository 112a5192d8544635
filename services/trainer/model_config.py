"""The trainer's model, parallelism and weight-sync settings (sub-sections of [trainer])."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.config import StrictModel


class ModelConfig(StrictModel):
    """Which model the trainer builds and in what precision."""

    hf_path: str = Field(
        "", description="Hugging Face model folder (config.json and safetensors) to start from"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="parameter dtype of the megatron model"
    )
    seed: int = Field(1234, ge=0, description="seed of megatron's model-parallel RNG tracker")
    attention_backend: Literal["fused", "local", "te"] = Field(
        "fused",
        description="core attention: fused (torch SDPA flash/cuDNN for padded rows and packed"
        " sequences of 1k+ tokens, varlen flash for shorter packed ones; the math kernels on"
        " CPU), local (megatron's local spec,"
        " [heads, S, S] scores in memory; no packed rows), te (TransformerEngine's spec; needs"
        " transformer_engine importable)",
    )
    fused_output_logprobs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="run the output layer inside the log-prob chunks, recomputing each chunk's"
        " logits in the backward: no [tokens, vocab] logits kept, one more output-layer matmul"
        " a micro-batch (about 6% of a 0.5B step on an H200); auto: on where the model lives"
        " in host RAM, and on GPUs where a micro-batch's whole logits would pass 4 GiB (a"
        " 65,536-token row of a 154,880-word vocabulary: 19 GiB, and as much for their"
        " gradient), off otherwise; pipeline and context parallel always keep whole logits",
    )
    compile_layers: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile each transformer layer (inductor: the layer's elementwise"
        " kernels fused, its Python out of the GPU's way); the first micro-batch of a new shape"
        " compiles; auto: on where the model is on a GPU, off on the CPU",
    )
    grouped_experts: Literal["auto", "on", "off"] = Field(
        "auto",
        description="MoE layers run all local experts' SwiGLU FFNs as grouped matmuls over the"
        " tokens sorted by expert (torch._grouped_mm on CUDA in bf16, one padded batched matmul"
        " elsewhere) instead of megatron's SequentialMLP, a Python loop over experts; same"
        " weights and checkpoint names either way (not the optimizer state's layout); auto: on"
        " (the CPU measured faster grouped too)",
    )
    recompute_granularity: Literal["none", "full", "selective"] = Field(
        "none",
        description="megatron activation recomputation: full (whole layers, see method and"
        " num_layers), selective (the core attention only), none",
    )
    recompute_method: Literal["uniform", "block"] = Field(
        "uniform",
        description="full recompute: uniform (checkpoint every group of recompute_num_layers"
        " layers) or block (recompute only the first recompute_num_layers of each stage)",
    )
    recompute_num_layers: int = Field(
        1, ge=1, description="full recompute: layers per group (uniform) or per stage (block)"
    )

    def recompute(self) -> dict[str, object] | None:
        """megatron TransformerConfig's recompute_* fields for these settings (None: off)."""
        if self.recompute_granularity == "none":
            return None
        if self.recompute_granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
        return {"recompute_granularity": "full", "recompute_method": self.recompute_method,
                "recompute_num_layers": self.recompute_num_layers}  # fmt: skip


class ParallelConfig(StrictModel):
    """How the trainer's ranks split the model; DP is whatever is left of the world size."""

    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel size (TP)")
    pipeline_parallel: int = Field(1, ge=1, description="pipeline-parallel size (PP)")
    context_parallel: int = Field(1, ge=1, description="context-parallel size (CP)")
    expert_parallel: int = Field(
        1, ge=1,
        description="expert-parallel size (EP, MoE only; expert TP is 1, so EP takes its ranks"
        " from TP x CP x DP and must divide it)",
    )
    sequence_parallel: bool = Field(
        False,
        description="split the activations between attention and MLP along the sequence over"
        " the TP ranks (needs tensor_parallel > 1; MoE models with TP > 1 need it)",
    )
    data_parallel: int | None = Field(
        None, ge=1, description="expected DP size; checked against world size / (TP*PP*CP)"
    )
    num_layers_per_stage: list[int] | None = Field(
        None,
        description="each pipeline stage's number of decoder layers, first stage first (one"
        " entry per stage, summing to the model's layers; unset: an even split)",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend (auto: nccl with CUDA, else gloo)"
    )
    init_timeout_s: float = Field(300.0, gt=0, description="rendezvous timeout of the ranks")
    launcher: Literal["local", "external"] = Field(
        "local",
        description="local: rank 0 starts the other ranks on its own machine; external: srun "
        "or torchrun starts every rank (RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS, "
        "MASTER_ADDR, MASTER_PORT), which lets the trainer span nodes",
    )

    @model_validator(mode="after")
    def _check_stages(self) -> ParallelConfig:
        stages = self.num_layers_per_stage
        if stages is not None and (len(stages) != self.pipeline_parallel or min(stages) < 1):
            raise ValueError(
                f"num_layers_per_stage = {stages} needs one positive layer count per pipeline"
                f" stage (pipeline_parallel = {self.pipeline_parallel})"
            )
        return self

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel


class WeightSyncConfig(StrictModel):
    """How new weights reach the engines after a step."""

    mode: Literal["rollout", "direct", "colocated", "colocated_direct", "off"] = Field(
        "rollout",
        description="rollout: broadcast through Rollout.UpdateWeights; direct: post to "
        "engine_urls; colocated: CUDA IPC handles (no group) through Rollout.UpdateWeights; "
        "colocated_direct: CUDA IPC handles posted to engine_urls on this host; off",
    )
    interval_steps: int = Field(1, ge=1, description="sync after every k-th optimizer step")
    release_engines_during_step: bool = Field(
        False, description="colocated modes: the engines free their memory (KV cache, weights)"
        " before each trainer step and the next sync resumes it (synchronous colocated "
        "training; generation waits meanwhile)")
    bucket_mb: float | None = Field(
        None, gt=0, description="size of one bucket in MiB (default: 512 for a broadcast, 2048 "
        "for the colocated modes, where fewer, larger buckets save round trips and a staged "
        "bucket's buffer stays allocated on the trainer's device)")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype of the tensors on the wire (the engines' dtype)"
    )
    master_address: str = Field("127.0.0.1", description="trainer rank 0's rendezvous address")
    master_port: int = Field(0, ge=0, le=65535, description="rendezvous port (0: a free one)")
    group_name: str = Field(
        "riptide-weights", min_length=1,
        description="prefix of the weight-update group's name (a random suffix is added)",
    )
    rollout_address: str = Field(
        "127.0.0.1:50052", description="host:port of the rollout service's gRPC endpoint"
    )
    engine_urls: list[str] = Field(
        default_factory=list, description="engine base URLs for mode=direct"
    )
    timeout_s: float = Field(600.0, gt=0, description="limit for one whole weight update")
    retry_initial_s: float = Field(
        1.0, gt=0, le=600, description="wait before retrying a failed sync (doubles each try)"
    )
    retry_max_s: float = Field(
        30.0, gt=0, le=3600, description="longest wait between two tries of a failed sync"
    )
    check_interval_s: float = Field(
        5.0, gt=0, le=3600,
        description="while waiting for groups, how often to ask whether the engines need "
        "the current weights (a restarted rollout service)",
    )

    @property
    def bucket_size_mb(self) -> float:
        """`bucket_mb`, or the mode's default."""
        if self.bucket_mb is not None:
            return self.bucket_mb
        return 2048.0 if self.mode in ("colocated", "colocated_direct") else 512.0

    @model_validator(mode="after")
    def _check_targets(self) -> WeightSyncConfig:
        if self.mode in ("direct", "colocated_direct") and not self.engine_urls:
            raise ValueError(f"mode={self.mode} needs engine_urls (the engines' base URLs)")
        if self.release_engines_during_step and self.mode not in ("colocated",
                                                                  "colocated_direct"):
            raise ValueError("release_engines_during_step needs mode colocated or "
                             "colocated_direct (the engines share the trainer's devices)")
        if self.mode in ("rollout", "colocated") and not self.rollout_address:
            raise ValueError(f"mode={self.mode} needs rollout_address (host:port of rollout "
                             "gRPC)")
        return self
