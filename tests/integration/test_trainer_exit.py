"""`riptide serve trainer` whose loop fails ends the process with a non-zero code instead of
living on in phase `failed` with /readyz 503: here 2, a config error (no model at hf_path),
which supervisors do not restart; any other failure exits 1 (tests/unit/trainer/
test_service_exit.py), which they do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import dump_config
from services.common.ports import free_ports
from services.deployment import validate_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_trainer_without_its_model_exits_2(tmp_path: Path) -> None:
    grpc_port, admin_port, redis_port = free_ports(3)
    config = validate_config({
        "run": {"admin_token": "a-token-of-some-length", "log_format": "text"},
        "redis": {"url": f"redis://127.0.0.1:{redis_port}/0"},
        "trainer": {"host": "127.0.0.1", "grpc_port": grpc_port, "admin_port": admin_port,
                    "model": {"hf_path": str(tmp_path / "no-model-here")}}})
    path = tmp_path / "deploy.toml"
    path.write_text(dump_config(config))
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", "trainer",
                           "--config", str(path)], capture_output=True, text=True,
                          timeout=180, cwd=REPO)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "exiting with code 2: the training loop failed: ConfigError: trainer.model." \
           f"hf_path: no Hugging Face model at {tmp_path / 'no-model-here'}" in done.stderr
