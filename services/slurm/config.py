"""The [slurm] section: which nodes run which steps, and how failed steps are restarted."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.config import StrictModel


class SlurmConfig(StrictModel):
    """Placement of the deployment's `srun` steps inside one Slurm job."""

    head_node: str = Field(
        "", description="node running Redis, router, sandbox and rollout (empty: no Slurm run)")
    trainer_nodes: list[str] = Field(
        default_factory=list, description="nodes of the trainer step; rank 0 on the first")
    trainer_ranks_per_node: int = Field(1, ge=1, description="trainer ranks (GPUs) per node")
    trainer_master_port: int = Field(
        29500, ge=1, le=65535, description="port on the first trainer node where ranks meet")
    engine_program: Literal["sglang", "builtin"] = Field(
        "sglang", description="what each engine step runs: SGLang or the built-in engine")
    engine_nodes: list[str] = Field(
        default_factory=list, description="inference nodes, nodes_per_engine of them per engine")
    nodes_per_engine: int = Field(1, ge=1, description="nodes one engine spans (TP over nodes)")
    engine_port: int = Field(30000, ge=1, le=65535, description="HTTP port of every engine")
    engine_dist_port: int = Field(
        30100, ge=1, le=65535, description="rendezvous port of an engine spanning nodes")
    bind_host: str = Field(
        "0.0.0.0", description="interface Redis and the engines listen on (each wants a "
                               "credential: Redis its password, engines run.engine_api_key)")
    redis_dir: str = Field(
        "redis", description="Redis's append-only file and its private redis.conf live here")
    secrets_dir: str = Field(
        "secrets", description="private folder (mode 0700) of the files that hand secrets to "
                               "steps: the SGLang engines' API key file")
    log_dir: str = Field("logs", description="one log file per step, appended across restarts")
    srun_args: list[str] = Field(
        default_factory=list, description="extra srun flags of every step (container, gres)")
    sandbox_env_files: dict[str, str] = Field(
        default_factory=dict,
        description="environment of the sandbox step read from files (name: path, mode 0600)")
    max_restarts: int = Field(3, ge=0, description="restarts of one step before the job fails")
    restart_delay_s: float = Field(5.0, ge=0, description="pause before restarting a step")
    ready_timeout_s: float = Field(
        1800.0, gt=0, description="time a step has to get ready at start")
    stop_grace_s: float = Field(
        60.0, gt=0, description="time steps have to exit after SIGTERM before SIGKILL")

    @model_validator(mode="after")
    def _check(self) -> SlurmConfig:
        if len(self.engine_nodes) % self.nodes_per_engine:
            raise ValueError(
                f"{len(self.engine_nodes)} engine_nodes do not split into engines of "
                f"nodes_per_engine = {self.nodes_per_engine}; give a multiple of it")
        return self

    @property
    def engines(self) -> list[list[str]]:
        """The nodes of each engine, first node first."""
        n = self.nodes_per_engine
        return [self.engine_nodes[i:i + n] for i in range(0, len(self.engine_nodes), n)]
