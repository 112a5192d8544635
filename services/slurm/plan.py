"""The printed plan of a Slurm deployment: processes per node, the config, memory estimates.

Used by recipes (`plan`, `train --dry-run`) before anything starts, so a reader sees which
process runs on which node with which command line, the exact deployment file, and whether
the model fits, with the formula behind each number.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from services.common.config import dump_config
from services.common.redis_server_config import describe_server
from services.deployment import secrets_of
from services.slurm.memory import Estimate, engine_gpu, model_size, trainer_rank
from services.slurm.steps import deployment_steps, engine_key_file


def render_steps(config: Any, config_path: Path) -> str:
    """Each node with the steps that run on it, and every step's srun command line."""
    steps = deployment_steps(config, config_path)
    s = config.slurm
    by_node: dict[str, list[str]] = {n: [] for n in [s.head_node, *s.trainer_nodes,
                                                     *s.engine_nodes]}
    for step in steps:
        for node in step.nodes:
            tasks = f" x{step.ntasks_per_node}" if step.ntasks_per_node > 1 else ""
            by_node.setdefault(node, []).append(step.name + tasks)
    lines = ["## Processes per node"]
    lines += [f"  {node}: {', '.join(names)}" for node, names in by_node.items()]
    lines.append("")
    lines.append("## srun steps (started in this order, restarted when they fail)")
    log_dir = Path(config.slurm.log_dir)
    for step in steps:
        env = [f"{k}={v}" for k, v in step.env.items()]
        env += [f"{k}=$(cat {v})" for k, v in step.env_files.items()]
        prefix = f"{' '.join(env)} " if env else ""
        lines.append(f"  [{step.name}] {prefix}"
                     f"{shlex.join(step.srun_argv(log_dir, config.slurm.srun_args))}")
    return "\n".join(lines)


def _table(title: str, rows: list[Estimate]) -> list[str]:
    lines = [title]
    lines += [f"  {e.what:<36} {e.gb:>10.2f}   = {e.formula}" for e in rows]
    return lines


def render_memory(config: Any, hf: dict[str, Any], gpu_memory_gb: float,
                  engine_weight_bytes: float) -> str:
    """Memory estimates of the fullest trainer rank (none in score mode) and one engine GPU
    (GB unless named)."""
    size = model_size(hf)
    lines = ["## Memory estimates (GB unless named; planning figures, not measurements)",
             f"  model: {size.total / 1e9:.1f}B parameters, {size.active / 1e9:.1f}B active "
             f"per token = embeddings x 2 + layers x attention + dense MLPs + MoE layers x "
             f"(routed + shared experts)"]
    if config.rollout.mode == "train":  # score mode runs no trainer
        lines += _table("  trainer rank:", trainer_rank(size, config.trainer))
    lines += _table("  engine GPU:", engine_gpu(size, config.rollout.fleet.sglang,
                                                gpu_memory_gb, engine_weight_bytes))
    return "\n".join(lines)


def render_config(config: Any) -> str:
    """The deployment file exactly as it is written (the secrets masked)."""
    text = dump_config(config)
    for name, secret in secrets_of(config).items():
        text = text.replace(secret, f"<{name}>")
    return "## Deployment config\n" + text


def render_security(config: Any) -> str:
    """Every listener of the deployment with the credential it wants, and where each secret
    lives (never the secret itself)."""
    s = config.slurm
    lines = ["## Who may connect (secrets live in the deployment file, mode 0600, or in "
             "RIPTIDE_* variables; none is on a command line)"]
    if config.rollout.mode != "score":
        lines.append(f"  redis   {config.redis.host}:{config.redis.port}  "
                     f"{describe_server(config.redis, [s.bind_host])}")
    if s.engine_nodes:
        how = (f"SGLang's --api-key from {engine_key_file(config)}, mode 0600"
               if s.engine_program == "sglang" else "the built-in engine reads it from the file")
        lines.append(f"  engines :{s.engine_port} on {s.bind_host}  run.engine_api_key "
                     f"required ({how})")
    channel = "over TLS (run.grpc_tls)" if config.run.grpc_tls else "in plaintext"
    http = "over TLS (run.http_tls)" if config.run.http_tls else "plain HTTP"
    for name in ("router", "sandbox", "rollout", "trainer"):
        section = getattr(config, name)
        if name == "trainer" and config.rollout.mode == "score":
            continue
        lines.append(f"  {name:<7} gRPC {section.listen_host}:{section.grpc_port} "
                     f"{channel}, run.grpc_token on every call but health checks; admin "
                     f"{section.listen_host}:{section.admin_port} {http}, run.admin_token on "
                     f"/admin/ (/healthz, /readyz, /metrics open)")
    if config.rollout.mode != "score":
        sync = config.trainer.weight_sync
        lines.append(f"  trainer rendezvous {config.trainer.host}:{s.trainer_master_port}, weight-"
                     f"update group at {sync.master_address}: bound to "
                     "that address only (torch.distributed stores have no credential)")
    if config.router.http_port is not None:
        lines.append(f"  router  HTTP front {config.router.listen_host}:"
                     f"{config.router.http_port} {http}, run.engine_api_key (sglang-router's "
                     "--api-key)")
    return "\n".join(lines)
