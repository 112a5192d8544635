"""The `srun` steps of a deployment: what runs where, with which command line.

From a validated deployment config (its [slurm] section places the steps): Redis, the router,
the sandbox and the rollout service on the head node, one engine per `nodes_per_engine`
inference nodes, and the trainer's ranks over the trainer nodes; in the rollout's `score` mode
neither Redis nor the trainer. Used by the supervisor that runs them and by `plan` output.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from services.common.errors import ConfigError


@dataclass(frozen=True)
class Step:
    """One `srun` step: its nodes, tasks, command and how to tell it is ready."""

    name: str
    nodes: list[str]
    ntasks_per_node: int
    command: list[str]
    ready_url: str  # http(s)://... answered with 200 when ready, or tcp://host:port
    env: dict[str, str] = field(default_factory=dict)
    env_files: dict[str, str] = field(default_factory=dict)  # variable: file with its value

    @property
    def role(self) -> str:
        return self.name.split("-")[0]

    def srun_argv(self, log_dir: Path, srun_args: list[str]) -> list[str]:
        """The whole `srun` command line of this step."""
        n = len(self.nodes)
        return ["srun", "--overlap", f"--job-name={self.name}", f"--nodes={n}",
                f"--ntasks={n * self.ntasks_per_node}",
                f"--ntasks-per-node={self.ntasks_per_node}", f"--nodelist={','.join(self.nodes)}",
                "--kill-on-bad-exit=1", f"--output={log_dir / self.name}.log",
                "--open-mode=append", *srun_args, *self.command]


def _host_port(url: str, what: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ConfigError(f"{what} = {url!r} needs an explicit host and port")
    return parts.hostname, parts.port


def deployment_steps(config: Any, config_path: Path, python: str = sys.executable) -> list[Step]:
    """Every step of the deployment in start order, where what a step calls is up before it
    (the rollout service never calls the trainer, so episodes run while the trainer builds
    its model); ConfigError says what does not fit."""
    s = config.slurm
    scoring = config.rollout.mode == "score"  # no stream and no trainer: no Redis either
    if not s.head_node or not (s.trainer_nodes or scoring):
        raise ConfigError("slurm.head_node and slurm.trainer_nodes must be set to run on Slurm")
    if scoring and s.trainer_nodes:
        raise ConfigError("rollout.mode 'score' runs no trainer: leave slurm.trainer_nodes "
                          "empty (those nodes would sit idle)")

    def serve(name: str, *sets: str) -> list[str]:
        extra = [arg for item in sets for arg in ("--set", item)]
        return [python, "-m", "services.cli", "serve", name, "--config", str(config_path), *extra]

    check_credentials(config)
    head = [s.head_node]
    host, port = _host_port(config.redis.url, "redis.url")
    # Writes its private redis.conf (ACL user, password hash) from the deployment file, then
    # execs redis-server: the password is on no command line.
    redis_cmd = [python, "-m", "services.cli", "redis-server", "--config", str(config_path),
                 "--bind", s.bind_host, "--dir", s.redis_dir]
    steps = [] if scoring else [Step("redis", head, 1, redis_cmd, f"tcp://{host}:{port}")]
    steps += _engine_steps(config, serve)
    for name in ("router", "sandbox"):
        section = getattr(config, name)
        files = dict(s.sandbox_env_files) if name == "sandbox" else {}
        steps.append(Step(name, head, 1, serve(name), f"{config.run.admin_url(section)}/readyz",
                          env_files=files))
    steps.append(Step("rollout", head, 1, serve("rollout"),
                      f"{config.run.admin_url(config.rollout)}/readyz"))
    if not scoring:
        steps.append(_trainer_step(config, serve))
    return steps


def check_credentials(config: Any) -> None:
    """Every listener of the deployment wants a credential: Redis its password, the engines
    (and the router's HTTP front) the engine API key, gRPC the token; ConfigError names the
    missing one."""
    s, run = config.slurm, config.run
    missing = []
    if config.rollout.mode != "score" and not config.redis.password:
        missing.append("redis.password (or RIPTIDE_REDIS_PASSWORD): Redis requires a login")
    if s.engine_nodes and not run.engine_api_key:
        missing.append(f"run.engine_api_key (or RIPTIDE_ENGINE_API_KEY): the engines listen on "
                       f"{s.bind_host}")
    if not run.grpc_token:
        missing.append("run.grpc_token (or RIPTIDE_GRPC_TOKEN): the services' gRPC ports "
                       "reach across nodes")
    if missing:
        raise ConfigError("the Slurm deployment needs its secrets: set " + "; ".join(missing))


def engine_key_file(config: Any) -> Path:
    """SGLang's `--config` YAML with the engine API key, in slurm.secrets_dir (written mode
    0600 by the supervisor before the engine steps start)."""
    return Path(config.slurm.secrets_dir) / "engine-api-key.yaml"


def _engine_steps(config: Any, serve: Any) -> list[Step]:
    s, fleet = config.slurm, config.rollout.fleet
    engines = s.engines
    if not engines:
        return []
    if fleet.kind != "attach" or len(fleet.attach_urls) != len(engines):
        raise ConfigError(
            f"slurm runs {len(engines)} engine step(s), so rollout.fleet.kind must be 'attach' "
            f"with one attach_urls entry per engine (it has kind {fleet.kind!r} and "
            f"{len(fleet.attach_urls)} urls)")
    version = config.rollout.weight_update.initial_weight_version
    steps = []
    for i, (nodes, url) in enumerate(zip(engines, fleet.attach_urls, strict=True)):
        if s.engine_program == "builtin":
            if len(nodes) > 1:
                raise ConfigError("the built-in engine runs on one node: nodes_per_engine = 1")
            command = serve("engine", f"engine.host={json.dumps(s.bind_host)}",
                            f"engine.port={s.engine_port}",
                            f"engine.weight_version={json.dumps(str(version))}")
        else:
            command = _sglang_command(config, nodes, version)
        steps.append(Step(f"engine-{i}", nodes, 1, command, f"{url.rstrip('/')}/health"))
    return steps


def _sglang_command(config: Any, nodes: list[str], version: int) -> list[str]:
    from services.rollout.sglang_command import fleet_route_shape, sglang_command

    s, fleet = config.slurm, config.rollout.fleet
    if not fleet.model_path:
        raise ConfigError("slurm.engine_program 'sglang' needs rollout.fleet.model_path")
    command = sglang_command(fleet.sglang, fleet.model_path, s.bind_host, s.engine_port, version,
                             python=sys.executable,
                             routed_experts=fleet_route_shape(fleet) is not None)
    command += ["--config", str(engine_key_file(config))]  # its --api-key, from a 0600 file
    if len(nodes) == 1:
        return command
    # One engine over several nodes: every node's task joins at the first node.
    command += ["--nnodes", str(len(nodes)), "--dist-init-addr", f"{nodes[0]}:{s.engine_dist_port}"]
    return ["bash", "-c", f'exec {shlex.join(command)} --node-rank "$SLURM_NODEID"']


def _trainer_step(config: Any, serve: Any) -> Step:
    s, trainer = config.slurm, config.trainer
    num_ranks = len(s.trainer_nodes) * s.trainer_ranks_per_node
    env = {}
    if trainer.parallel.launcher == "external":
        env = {"MASTER_ADDR": trainer.host, "MASTER_PORT": str(s.trainer_master_port)}
    elif num_ranks > 1:
        raise ConfigError(
            f"the trainer step has {num_ranks} ranks, which srun starts: set "
            "trainer.parallel.launcher = 'external' (or one trainer node with one rank)")
    return Step("trainer", list(s.trainer_nodes), s.trainer_ranks_per_node, serve("trainer"),
                f"{config.run.admin_url(trainer)}/readyz", env)
