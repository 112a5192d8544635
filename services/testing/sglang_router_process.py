"""The real sglang-router (`pip install sglang-router`) as a child process: the reference the
router's bench measures Riptide's router against, on the same engines in the same run.

It runs sglang-router's manual policy with min_load assignment by default (a new routing key
goes to the worker with the fewest requests, then sticks), the policy a client of
sglang-router would pick for multi-turn sessions. Its health checks run every second so an
ejection is seen about as fast as the Riptide router sees it.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from services.common import process
from services.common.ports import free_port


def sglang_router_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


class SglangRouterProcess:
    """`python -m sglang_router.launch_router` on a free loopback port over `worker_urls`."""

    def __init__(self, worker_urls: list[str], *, policy: str = "manual",
                 assignment_mode: str = "min_load", start_timeout_s: float = 60.0) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="riptide-sglang-router-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = ["-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(self.port), "--worker-urls", *worker_urls, "--policy", policy,
               "--health-check-interval-secs", "1", "--log-level", "warn",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        if policy == "manual":
            cmd += ["--assignment-mode", assignment_mode]
        self.proc = process.spawn([sys.executable, *cmd], log_path=self._dir / "router.log")
        expected = len(worker_urls)
        try:
            process.wait_until_ready(lambda: self._healthy_workers() >= expected, self.proc,
                                     "sglang-router", start_timeout_s, self.log_tail)
        except BaseException:
            self.stop()
            raise

    def _healthy_workers(self) -> int:
        try:
            reply = httpx.get(f"{self.url}/workers", timeout=1)
            workers = reply.json().get("workers", []) if reply.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return 0
        return sum(1 for w in workers if w.get("is_healthy"))

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return (self._dir / "router.log").read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        process.stop(self.proc, grace_s=5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
