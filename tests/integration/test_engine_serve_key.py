"""`riptide serve engine` is guarded by the deployment's `run.engine_api_key` (the way Slurm
runs built-in engines): 401 in SGLang's shape without it, 200 with it, /health open; the key
is on no command line."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common import process
from services.common.ports import free_ports
from services.testing.engine_process import tiny_model_path

pytestmark = pytest.mark.slow
KEY = "deployment-engine-key-1"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_engine_requires_the_deployments_key(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    config = tmp_path / "deploy.toml"
    config.write_text(f'[run]\nadmin_token = "0123456789"\nengine_api_key = "{KEY}"\n'
                      f'[engine]\nport = {port}\nmodel_path = "{tiny_model_path()}"\n')
    child = process.spawn([sys.executable, "-m", "services.cli", "serve", "engine",
                           "--config", str(config)], log_path=tmp_path / "engine.log")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert child.poll() is None, (tmp_path / "engine.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the engine did not come up"
            time.sleep(0.2)
        refused = httpx.get(f"{url}/model_info", timeout=10)
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
        answered = httpx.get(f"{url}/model_info", timeout=10,
                             headers={"Authorization": f"Bearer {KEY}"})
        assert answered.status_code == 200, answered.text
        assert KEY not in Path(f"/proc/{child.pid}/cmdline").read_bytes().decode()
    finally:
        process.stop(child)
