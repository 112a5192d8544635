"""The whole deployment's config: one model with a section per service.

This is the composition root's view of a deployment file: the CLI, the local stack and the
recipe load it here. Services never import it; each one receives its own section.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, create_model

from services.common.config import (
    RedisConfig,
    RunConfig,
    StrictModel,
    read_config_file,
    validate_section,
)
from services.common.errors import ConfigError


def _section_models() -> dict[str, type[StrictModel]]:
    from services.engine.config import EngineConfig
    from services.rollout.config import RolloutConfig
    from services.router.config import RouterConfig
    from services.sandbox.config import SandboxConfig
    from services.slurm.config import SlurmConfig
    from services.trainer.config import TrainerConfig

    return {
        "router": RouterConfig,
        "rollout": RolloutConfig,
        "sandbox": SandboxConfig,
        "trainer": TrainerConfig,
        "engine": EngineConfig,
        "slurm": SlurmConfig,
    }


def deployment_model() -> type[StrictModel]:
    """The pydantic model of a whole deployment file, built from each service's section."""
    fields: dict[str, Any] = {
        "run": (RunConfig, ...),
        "redis": (RedisConfig, Field(default_factory=lambda: RedisConfig())),
    }
    for name, model in _section_models().items():
        fields[name] = (model, Field(default_factory=model))
    return create_model("DeploymentConfig", __base__=StrictModel, **fields)


def validate_config(data: dict[str, Any], source: str = "config") -> Any:
    """Validate a parsed config dict into a DeploymentConfig, or raise a precise ConfigError."""
    config = validate_section(deployment_model(), data, source)
    check_sampling_temperature(config, source)
    return config


def check_sampling_temperature(config: Any, source: str = "config") -> None:
    """The trainer's log-probs must be of the distribution the engines sample from: unless
    the file sets it, the trainer's temperature follows the rollout's (greedy sampling,
    T = 0, trains at T = 1); a different one set by hand is an error."""
    sampled = config.rollout.scheduler.temperature
    expected = sampled if sampled > 0 else 1.0
    if "sampling_temperature" not in config.trainer.model_fields_set:
        config.trainer.sampling_temperature = expected
        config.trainer.model_fields_set.discard("sampling_temperature")
        return
    trained = config.trainer.sampling_temperature
    if abs(trained - expected) > 1e-9:
        raise ConfigError(
            f"{source}: trainer.sampling_temperature ({trained:g}) differs from "
            f"rollout.scheduler.temperature ({sampled:g}): the trainer's log-probs would be of "
            f"another distribution than the one sampled; set both to the same value (or "
            f"leave trainer.sampling_temperature out: it follows the rollout's)")


#: Environment variables that set the deployment's secrets, so they never need a command line
#: (which every local user can read in /proc); they win over the file and --set.
SECRET_ENV = {"RIPTIDE_ADMIN_TOKEN": ("run", "admin_token"),
              "RIPTIDE_GRPC_TOKEN": ("run", "grpc_token"),
              "RIPTIDE_ENGINE_API_KEY": ("run", "engine_api_key"),
              "RIPTIDE_REDIS_PASSWORD": ("redis", "password")}


def load_config(path: str | Path, overrides: list[str] | None = None) -> Any:
    """Read a deployment TOML file, apply `section.key=value` overrides and the secrets from
    the environment (SECRET_ENV), validate."""
    data = read_config_file(path, overrides)
    for variable, (section, key) in SECRET_ENV.items():
        if os.environ.get(variable):
            data.setdefault(section, {})[key] = os.environ[variable]
    return validate_config(data, str(path))


def secrets_of(config: Any) -> dict[str, str]:
    """The deployment's secrets that are set, by name (`redis password`, `admin token`, ...),
    to mask them wherever a config or a command is shown."""
    found = {}
    for section, key in SECRET_ENV.values():
        value = getattr(getattr(config, section), key)
        if value:
            found[f"{section} {key}".replace("run ", "").replace("_", " ")] = value
    return found
