"""Start one built-in engine as a child process for the length of a `with` block.

`riptide eval` serves the model it scores this way; the rollout service launches its fleet
itself (services/rollout/fleet.py).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from services.common import process
from services.common.engine_contract import API_KEY_ENV
from services.common.errors import Unavailable


@contextmanager
def running_engine(model_path: Path, log_path: Path, timeout_s: float = 300.0,
                   extra_args: list[str] | None = None,
                   api_key: str | None = None) -> Iterator[str]:
    """The URL of a healthy built-in engine serving `model_path`, requiring `api_key` when
    given (handed over in the environment, not argv); stopped on exit."""
    ready = log_path.with_suffix(".port")
    ready.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    child = process.spawn([sys.executable, "-m", "services.engine", "--model", str(model_path),
                           "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
                           *(extra_args or [])], log_path=log_path,
                          env={**os.environ, API_KEY_ENV: api_key} if api_key else None)
    try:
        deadline = time.monotonic() + timeout_s
        url = ""
        while True:
            if child.poll() is not None:
                raise Unavailable(f"the engine exited with code {child.returncode} while "
                                  f"starting; see {log_path}")
            if time.monotonic() > deadline:
                raise Unavailable(f"the engine was not healthy after {timeout_s:.0f} s; "
                                  f"see {log_path}")
            if not url and ready.is_file() and ready.read_text().strip():
                url = f"http://127.0.0.1:{int(ready.read_text())}"
            if url and _healthy(url):
                break
            time.sleep(0.2)
        yield url
    finally:
        process.stop(child)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
