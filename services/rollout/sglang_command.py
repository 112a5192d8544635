"""Command lines of the engines the fleet launches: SGLang's server or the built-in engine,
and how each receives its API key without it showing on the command line (every local user
can read those in /proc): the built-in engine from an environment variable, SGLang from a
private `--config` YAML file (SGLang reads every server flag from one)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from services.common.engine_contract import API_KEY_ENV
from services.common.errors import ConfigError
from services.common.routed_experts import moe_route_shape
from services.rollout.config import FleetConfig, SGLangConfig

#: The server flag under which SGLang (and the built-in engine) return routed experts.
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


def fleet_route_shape(config: FleetConfig) -> tuple[int, int] | None:
    """(MoE layers, top-k) of the fleet's model when its episodes record routed experts for
    routing replay (fleet.routed_experts, by default on for MoE models), else None."""
    if config.routed_experts is False or not config.model_path:
        if config.routed_experts:
            raise ConfigError("rollout.fleet.routed_experts = true needs fleet.model_path (the "
                              "MoE model, for the routes' shape)")
        return None
    shape = moe_route_shape(config.model_path)
    if shape is None and config.routed_experts:
        raise ConfigError(f"rollout.fleet.routed_experts = true but {config.model_path} is not "
                          "an MoE model here (its config.json is missing or names no routed "
                          "experts)")
    return shape


def sglang_command(config: SGLangConfig, model_path: str, host: str, port: int,
                   weight_version: int, python: str = sys.executable,
                   routed_experts: bool = False) -> list[str]:
    """`python -m sglang.launch_server ...` for one engine, from the [rollout.fleet.sglang]
    settings; every optional flag appears only when set (`routed_experts`: the engine
    returns each token's routed experts, for routing replay)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path,
           "--host", host, "--port", str(port),
           "--tp-size", str(config.tp_size), "--dp-size", str(config.dp_size)]
    if config.ep_size > 1:
        cmd += ["--ep-size", str(config.ep_size)]
    if config.enable_dp_attention:
        cmd.append("--enable-dp-attention")
    optional = {
        "--quantization": config.quantization,
        "--kv-cache-dtype": config.kv_cache_dtype,
        "--mem-fraction-static": config.mem_fraction_static,
        "--page-size": config.page_size,
        "--chunked-prefill-size": config.chunked_prefill_size,
        "--max-running-requests": config.max_running_requests,
        "--cuda-graph-max-bs": config.cuda_graph_max_bs,
    }
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    if config.enable_metrics:
        cmd.append("--enable-metrics")
    if routed_experts:
        cmd.append(ROUTED_EXPERTS_FLAG)
    cmd += ["--weight-version", str(weight_version), *config.extra_args]
    return cmd


def builtin_command(config: FleetConfig, host: str, port: int, weight_version: int,
                    python: str = sys.executable) -> list[str]:
    """`python -m services.engine ...` for one built-in engine."""
    routes = [ROUTED_EXPERTS_FLAG] if fleet_route_shape(config) is not None else []
    return [python, "-m", "services.engine", "--model", config.model_path,
            "--host", host, "--port", str(port), "--weight-version", str(weight_version),
            *routes, *config.builtin_args]


def engine_command(config: FleetConfig, host: str, port: int, weight_version: int) -> list[str]:
    """The command that starts one engine of the configured kind."""
    if config.kind == "sglang":
        return sglang_command(config.sglang, config.model_path, host, port, weight_version,
                              routed_experts=fleet_route_shape(config) is not None)
    if config.kind == "builtin":
        return builtin_command(config, host, port, weight_version)
    raise ValueError(f"fleet kind {config.kind!r} launches nothing")


def ranks_per_engine(config: FleetConfig) -> int:
    """Weight-update ranks of one launched engine (SGLang: one per tensor-parallel rank)."""
    return config.sglang.tp_size if config.kind == "sglang" else 1


def keyed_launch(config: FleetConfig, api_key: str | None, secrets_dir: Path,
                 index: int) -> tuple[list[str], dict[str, str] | None]:
    """(extra arguments, environment) that hand engine `index` its API key; nothing without
    one. SGLang's file lives in `secrets_dir`, readable by this user only."""
    if not api_key:
        return [], None
    if config.kind == "sglang":
        path = write_api_key_yaml(secrets_dir / f"engine-{index}.yaml", api_key)
        return ["--config", str(path)], None
    return [], {**os.environ, API_KEY_ENV: api_key}


def write_api_key_yaml(path: Path, api_key: str) -> Path:
    """SGLang's `--config` YAML that sets its --api-key, readable by this user only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(f"api-key: {json.dumps(api_key)}\n")  # a JSON string is YAML too
    return path
