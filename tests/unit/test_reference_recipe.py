"""The reference recipe's config is valid and takes the overrides its Slurm adapter passes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from services.deployment import load_config

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "glm52_tbench2"


def test_reference_config_validates_with_the_slurm_overrides() -> None:
    config = load_config(RECIPE / "deploy.toml", [
        'run.admin_token="a-token-from-a-file"',
        'redis.url="redis://node0:6379/0"',
        'rollout.fleet.attach_urls=["http://node8:30000", "http://node9:30000"]',
        'router.host="node0"',
    ])
    assert config.router.host == "node0" and config.router.policy == "sticky_min_load"
    assert config.rollout.fleet.attach_urls == ["http://node8:30000", "http://node9:30000"]
    assert config.rollout.scheduler.max_concurrent_samples == 128
    assert config.rollout.scheduler.batch_samples == 64
    assert config.sandbox.provider.type == "daytona"
    assert config.trainer.weight_sync.bucket_mb == 2048.0
    assert config.trainer.parallel.launcher == "external"


def test_slurm_adapter_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(RECIPE / "slurm.sh")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
