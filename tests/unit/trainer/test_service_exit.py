"""A trainer whose loop fails for a reason other than a weight sync ends its process (exit 1;
2 for a config error) instead of living on in phase `failed`, so its supervisor restarts it
and it resumes from its checkpoint."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.common.errors import ConfigError
from services.common.serve import serve
from services.deployment import validate_config
from services.trainer.service import TrainerRuntime


class FailingLoop:
    """Stands in for TrainerLoop: its first step raises."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.unpaused = asyncio.Event()  # only .clear()/.set() are called on it

    def run(self, should_stop: Any) -> None:
        raise self.error


def _serve_failing(error: Exception) -> tuple[int, TrainerRuntime]:
    config = validate_config({"run": {"name": "t", "admin_token": "a-token-of-some-length"},
                              "trainer": {"host": "127.0.0.1", "grpc_port": 0,
                                          "admin_port": 0}})
    runtime = TrainerRuntime(config.trainer, config.redis, "t", None)
    runtime._build_loop = lambda: FailingLoop(error)  # type: ignore[method-assign]

    async def main() -> int:
        return await asyncio.wait_for(serve(runtime, config.trainer, config.run), 30)

    return asyncio.run(main()), runtime


@pytest.mark.parametrize(("error", "code"), [
    (RuntimeError("CUDA error: an illegal memory access"), 1),
    (ConfigError("trainer.model.hf_path: no config.json"), 2),
])
def test_a_failed_loop_ends_the_process_with_a_code(error: Exception, code: int) -> None:
    exit_code, runtime = _serve_failing(error)
    assert exit_code == code
    assert runtime.error is not None and str(error) in runtime.error
    assert runtime.stats.phase == "failed" and not runtime.ready()
