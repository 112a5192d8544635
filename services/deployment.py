"""The whole deployment's config: one model with a section per service.

This is the composition root's view of a deployment file: the CLI, the local stack and the
recipe load it here. Services never import it; each one receives its own section.
"""

from __future__ import annotations

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
    return validate_section(deployment_model(), data, source)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Any:
    """Read a deployment TOML file, apply `section.key=value` overrides, validate."""
    return validate_config(read_config_file(path, overrides), str(path))
