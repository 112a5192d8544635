"""`riptide serve trainer`: the trainer runtime from a validated deployment config."""

from __future__ import annotations

from typing import Any

from services.trainer.service import TrainerRuntime


def build_runtime(deployment_config: Any) -> TrainerRuntime:
    """The trainer's ServiceRuntime; the model is built when it starts, not here."""
    c = deployment_config
    return TrainerRuntime(c.trainer, c.redis, c.run.name, c.run.grpc_token, c.run.events,
                          engine_api_key=c.run.engine_api_key, grpc_tls=c.run.grpc_tls)
