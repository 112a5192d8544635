"""The [rollout] section of the deployment config: scheduler, engine fleet, weight updates."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.config import ServiceConfig, StrictModel
from services.rollout.dashboard.config import DashboardConfig

Granularity = Literal["sample", "group"]
PauseMode = Literal["abort", "retract", "in_place"]
TaskSampling = Literal["cycle", "informative"]


class SchedulerConfig(StrictModel):
    """How many episodes run at once and when a new one may start (all live-tunable)."""

    max_concurrent_samples: int = Field(
        128, ge=1, le=1_000_000, description="episodes kept in flight")
    granularity: Granularity = Field(
        "sample", description="sample: refill each freed slot at once; group: a whole group")
    max_staleness: int | None = Field(
        8, ge=0, le=1_000_000,
        description="weight versions a group may lag the trainer (None: unbounded)")
    n_samples_per_prompt: int = Field(
        8, ge=1, le=4096, description="episodes per task in one group")
    num_groups_per_batch: int = Field(
        8, ge=1, le=100_000,
        description="groups the trainer consumes per weight version (staleness budget)")
    drop_zero_variance_groups: bool = Field(
        True, description="drop (and count) groups whose samples all have the same reward: "
        "their advantages are 0, so training on them costs a step and teaches nothing")
    zero_variance_cooldown_passes: int = Field(
        0, ge=0, le=1000,
        description="passes over the task set that a task sits out after a group of it came "
        "out with zero reward variance (0: never); spends generation on tasks that teach")
    task_sampling: TaskSampling = Field(
        "cycle", description="which task each group is of: cycle (shuffled passes, with the "
        "zero-variance cooldown) or informative (drawn by the chance that a group of the task "
        "has reward variance, from its recent groups)")
    task_sampling_window_groups: int = Field(
        4, ge=1, le=1000,
        description="informative: the recent groups of a task its pass rate is estimated from")
    task_sampling_floor: float = Field(
        0.05, gt=0, le=1, description="informative: the least weight of a task, so every task "
        "is drawn now and then")
    max_queued_groups: int = Field(
        16, ge=1, le=1_000_000,
        description="finished groups waiting for the buffer before admission stops")
    temperature: float = Field(0.8, ge=0, le=100, description="sampling temperature of every turn")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of every turn")
    max_new_tokens: int = Field(
        8192, ge=1, le=10_000_000, description="new tokens at most per turn")

    @property
    def batch_samples(self) -> int:
        """Samples the trainer consumes per weight version."""
        return self.num_groups_per_batch * self.n_samples_per_prompt

    @model_validator(mode="after")
    def _fits(self) -> SchedulerConfig:
        if self.granularity == "group" and self.max_concurrent_samples < self.n_samples_per_prompt:
            raise ValueError(
                f"granularity 'group' needs max_concurrent_samples >= n_samples_per_prompt "
                f"({self.n_samples_per_prompt}); raise it or use granularity 'sample'")
        return self


class SGLangConfig(StrictModel):
    """The `sglang.launch_server` flags of every launched SGLang engine."""

    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks per engine")
    dp_size: int = Field(1, ge=1, description="data-parallel ranks per engine")
    ep_size: int = Field(1, ge=1, description="expert-parallel ranks per engine")
    enable_dp_attention: bool = Field(False, description="DP attention (dp_size > 1)")
    quantization: str | None = Field(None, description="e.g. fp8; None: the checkpoint's own")
    kv_cache_dtype: str | None = Field(None, description="e.g. fp8_e4m3; None: auto")
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="static memory share")
    page_size: int | None = Field(None, ge=1, description="KV cache page size in tokens")
    chunked_prefill_size: int | None = Field(None, ge=1, description="prefill chunk in tokens")
    max_running_requests: int | None = Field(None, ge=1, description="running requests cap")
    cuda_graph_max_bs: int | None = Field(None, ge=1, description="largest CUDA-graph batch")
    enable_metrics: bool = Field(True, description="serve Prometheus /metrics")
    extra_args: list[str] = Field(default_factory=list, description="further flags, verbatim")

    @model_validator(mode="after")
    def _dp_attention(self) -> SGLangConfig:
        if self.enable_dp_attention and self.dp_size < 2:
            raise ValueError("enable_dp_attention needs dp_size >= 2")
        return self


class FleetConfig(StrictModel):
    """Which engines the rollout service launches or attaches, and how it supervises them."""

    kind: Literal["builtin", "sglang", "attach"] = Field(
        "builtin", description="launch built-in engines, launch SGLang, or attach to urls")
    num_engines: int = Field(0, ge=0, description="engines to launch (builtin, sglang)")
    model_path: str = Field("", description="model folder the launched engines load")
    engine_host: str = Field("127.0.0.1", description="address launched engines listen on")
    base_port: int = Field(0, ge=0, le=65535, description="first engine port (0: free ports)")
    attach_urls: list[str] = Field(default_factory=list, description="engines started elsewhere")
    builtin_args: list[str] = Field(
        default_factory=list, description="extra flags for `python -m services.engine`")
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description="SGLang flags")
    ranks_per_engine: int | None = Field(
        None, ge=1, description="weight-update ranks per attached engine (default: ask it)")
    health_interval_s: float = Field(2.0, gt=0, description="period of engine health checks")
    start_timeout_s: float = Field(600.0, gt=0, description="time an engine has to get healthy")
    max_restarts: int = Field(5, ge=0, description="restarts of one engine before giving up")
    max_missed_health_checks: int = Field(
        5, ge=1, le=10_000,
        description="a launched engine that is alive but misses this many health checks in a "
        "row (outside weight updates) is hung: it is killed and restarted")
    log_dir: str | None = Field(None, description="engine logs go here (None: discarded)")
    routed_experts: bool | None = Field(
        None, description="routing replay (MoE): engines return each token's routed experts "
        "and episodes record them for the trainer (None: on when model_path is an MoE model)")

    @model_validator(mode="after")
    def _urls(self) -> FleetConfig:
        if self.kind == "attach" and not self.attach_urls:
            raise ValueError("fleet.kind 'attach' needs fleet.attach_urls")
        if self.kind != "attach" and self.num_engines and not self.model_path:
            raise ValueError(f"fleet.kind {self.kind!r} launches engines: set fleet.model_path")
        return self


class WeightUpdateConfig(StrictModel):
    """How engines are paused and synced during Rollout.UpdateWeights."""

    pause_mode: PauseMode = Field("retract", description="engine pause mode during an update")
    step_timeout_s: float = Field(600.0, gt=0, description="time one engine call may take")
    initial_weight_version: int = Field(0, description="version the engines hold at start")


class EvalConfig(StrictModel):
    """Evaluation of held-out tasks: during training (every `interval_steps` weight versions)
    or once, in the rollout's `score` mode (services/rollout/evaluation.py, scoring.py)."""

    interval_steps: int = Field(0, ge=0, le=1_000_000, description="train mode: evaluate "
                                "every k weight versions and at the start (0: never)")
    task_ids: list[str] = Field(default_factory=list, description="held-out tasks (the sandbox "
                                                                  "must list them)")
    num_tasks: int = Field(0, ge=0, le=100_000, description="without task_ids: hold out this "
                           "many of the sandbox's tasks, drawn with `seed` from its sorted list "
                           "(score mode, 0 and no task_ids: every task)")
    seed: int = Field(0, description="seed of the num_tasks draw (same seed, same task set)")
    num_samples: int = Field(1, ge=1, le=4096, description="episodes per task and evaluation")
    greedy: bool = Field(True, description="sample greedily (else at `temperature`)")
    temperature: float = Field(0.8, gt=0, le=100,
                               description="sampling temperature when not greedy")
    success_threshold: float = Field(1.0, description="a reward at least this is a success")
    result_path: str | None = Field(None, description="score mode: the result JSON is written "
                                                      "here (per-task and mean success)")

    @model_validator(mode="after")
    def _one_task_set(self) -> EvalConfig:
        if self.task_ids and self.num_tasks:
            raise ValueError("eval.task_ids and eval.num_tasks both set: name the held-out "
                             "tasks or give their number, not both")
        return self


class RolloutConfig(ServiceConfig):
    """Settings of the rollout service."""

    grpc_port: int = Field(50052, ge=0, le=65535, description="gRPC port (0 picks a free one)")
    admin_port: int = Field(8052, ge=0, le=65535, description="admin REST port (0: a free one)")
    sandbox_address: str | None = Field(
        None, description="host:port of Sandbox gRPC (default: the [sandbox] section)")
    router_address: str | None = Field(
        None, description="host:port of Router gRPC (default: the [router] section)")
    task_ids: list[str] = Field(
        default_factory=list, description="tasks to draw from (empty: all the sandbox lists)")
    task_seed: int = Field(0, description="seed of the task sampler")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="admission")
    fleet: FleetConfig = Field(default_factory=FleetConfig, description="engines")
    weight_update: WeightUpdateConfig = Field(
        default_factory=WeightUpdateConfig, description="weight-update coordination")
    mode: Literal["train", "score"] = Field(
        "train", description="train: feed the sample stream; score: run [rollout.eval]'s "
        "episodes once at the engines' weights, write eval.result_path and exit 0 (no Redis, "
        "no trainer)")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation "
                                                                     "(train and score modes)")
    dashboard: DashboardConfig = Field(
        default_factory=DashboardConfig, description="the run dashboard at /dashboard")

    @model_validator(mode="after")
    def _score_mode(self) -> RolloutConfig:
        if self.mode == "score" and not self.eval.result_path:
            raise ValueError("rollout.mode 'score' writes its result to rollout.eval.result_path"
                             ": set it")
        return self
