"""Start the built-in engine (services/engine) as a child process, for tests and benches.

The engine runs in its own process group, so `stop()` and `kill()` reach it and nothing else.
Used by the engine's integration tests, the router's and rollout's tests, and bench/engine.py.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from services.common.engine_contract import API_KEY_ENV, bearer
from services.testing.child_server import ChildServer


def tiny_model_path(root: str | Path | None = None) -> Path:
    """The tiny random model in `root` (default: a per-user temp folder), created if absent."""
    from services.common.tiny_model import create_tiny_model

    folder = Path(root or Path(tempfile.gettempdir()) / "riptide-tiny-model")
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    # Build beside it and rename, so concurrent callers never see a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    create_tiny_model(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process won the race (or an old partial folder is in the way)
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "tokenizer.json").exists():
            raise
    return folder


class EngineProcess(ChildServer):
    """One built-in engine on a free loopback port; a context manager."""

    name = "engine"

    def __init__(
        self,
        model_path: str | Path,
        *,
        dp_size: int = 1,
        extra_args: list[str] | None = None,
        start_timeout_s: float = 120.0,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the engine requires it (given through its environment, as the fleet
        does) and `client` sends it."""
        self.model_path = Path(model_path)
        cmd = [sys.executable, "-m", "services.engine", "--model", str(model_path),
               "--host", "127.0.0.1", "--port", "0", "--dp-size", str(dp_size),
               *(extra_args or [])]
        env = {**os.environ, API_KEY_ENV: api_key} if api_key else None
        super().__init__(cmd, start_timeout_s, env)
        self.client = httpx.Client(base_url=self.url, timeout=120, headers=bearer(api_key))
        while self.client.get("/health").status_code != 200:
            self.check_starting("not healthy")
            time.sleep(0.05)

    def generate(self, input_ids: list[int], **body: Any) -> dict[str, Any]:
        """POST /generate with `input_ids`; raises on an HTTP error."""
        resp = self.client.post("/generate", json={"input_ids": input_ids, **body})
        resp.raise_for_status()
        return dict(resp.json())

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return self.client.post(path, json=body or {})

    def get(self, path: str) -> httpx.Response:
        return self.client.get(path)

    def stop(self) -> None:
        super().stop()
        if hasattr(self, "client"):
            self.client.close()
