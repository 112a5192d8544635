"""`riptide up`: Redis and the four services as child processes on loopback.

Writes the stack's config into a run directory, starts redis-server and each service with
`riptide serve`, waits until every one is ready, and stops them all (process groups, no
orphans) on Ctrl-C, on SIGTERM, when a child dies, or when the trainer reached `--steps`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from services.common import process
from services.common.config import deep_merge, dump_config
from services.common.errors import ConfigError, RiptideError, Unavailable
from services.common.ports import free_ports
from services.deployment import load_config, validate_config

#: Start order: what a service calls must be up before it.
SERVICE_ORDER = ("router", "sandbox", "trainer", "rollout")
REPO_ROOT = Path(__file__).resolve().parents[1]


def local_config(run_dir: Path, overrides: dict[str, dict[str, Any]] | None = None) -> Any:
    """A deployment config for one machine: loopback, free ports, fresh admin and gRPC tokens
    (the file is the only place they are written: children read them from it, not argv).

    `overrides` are merged at every depth (`{"trainer": {"model": {"hf_path": ...}}}` keeps
    the model's dtype); the trainer's sampling temperature follows the rollout's (deployment
    validation) unless an override sets it."""
    ports = iter(free_ports(1 + 2 * len(SERVICE_ORDER)))
    data: dict[str, Any] = {
        "run": {"name": "local", "admin_token": secrets.token_urlsafe(24),
                "grpc_token": secrets.token_urlsafe(24), "log_format": "json"},
        "redis": {"url": f"redis://127.0.0.1:{next(ports)}/0"},
    }
    for name in SERVICE_ORDER:
        data[name] = {"host": "127.0.0.1", "grpc_port": next(ports), "admin_port": next(ports)}
    for name, settings in _local_service_settings(run_dir).items():
        data[name].update(settings)
    data["trainer"]["weight_sync"]["rollout_address"] = (
        f"127.0.0.1:{data['rollout']['grpc_port']}")
    data = deep_merge(data, overrides or {})
    return validate_config(data, "local stack config")


def _local_service_settings(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The local stack's sizes: one tiny-model engine, short episodes, small batches."""
    model = str(run_dir / "model")
    return {
        "rollout": {
            "scheduler": {"max_concurrent_samples": 8, "n_samples_per_prompt": 4,
                          "num_groups_per_batch": 2, "max_new_tokens": 48,
                          "temperature": 1.0, "max_staleness": 4,
                          # A random model never scores: every group has zero variance.
                          "drop_zero_variance_groups": False},
            "fleet": {"kind": "builtin", "num_engines": 1, "model_path": model,
                      "log_dir": str(run_dir / "logs"), "start_timeout_s": 120.0},
        },
        "sandbox": {
            "tasks_dir": str(REPO_ROOT / "tasks"),
            "tokenizer_path": model,
            "max_concurrent_episodes": 16,
            "agent": {"max_turns": 3, "max_context_tokens": 4096, "max_new_tokens": 48,
                      "wall_time_s": 120.0, "default_command_timeout_s": 10.0},
        },
        "trainer": {
            "rollout_batch_size": 2,
            "model": {"hf_path": model, "dtype": "float32"},
            "optimizer": {"lr": 1e-4},
            "checkpoint": {"dir": str(run_dir / "checkpoints")},
            "weight_sync": {"dtype": "float32", "bucket_mb": 16.0},
        },
    }


def ensure_tiny_model(run_dir: Path) -> Path:
    """The local stack's model: a tiny random Llama with a byte-level tokenizer."""
    path = run_dir / "model"
    if not (path / "config.json").exists():
        from services.common.tiny_model import create_tiny_model

        create_tiny_model(path)
    return path


class LocalStack:
    """Redis plus the four services, each a child process with its own log file."""

    def __init__(self, run_dir: Path, config_path: Path,
                 say: Callable[[str], None] = print) -> None:
        self.run_dir = run_dir
        self.config_path = config_path
        self.config = load_config(config_path)
        self.say = say
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, ready_timeout_s: float = 300.0) -> None:
        self._start_redis()
        for name in SERVICE_ORDER:
            cmd = [sys.executable, "-m", "services.cli", "serve", name,
                   "--config", str(self.config_path)]
            self.children[name] = process.spawn(cmd, log_path=self._log(name), cwd=REPO_ROOT)
            self._wait_ready(name, ready_timeout_s)

    def _log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise Unavailable(
                "redis-server is not on PATH. Install it (Debian/Ubuntu: "
                "`sudo apt-get install -y redis-server`; macOS: `brew install redis`) "
                "or run `make demo`, which installs it when run as root.")
        port = int(self.config.redis.url.rsplit(":", 1)[1].split("/")[0])
        data_dir = self.run_dir / "redis"
        data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir),
               "--save", "", "--appendonly", "yes", "--protected-mode", "yes"]
        self.children["redis"] = process.spawn(cmd, log_path=self._log("redis"))
        self._wait(lambda: _redis_pings(port), "redis", 30.0)
        self.say(f"[up] redis      ready  127.0.0.1:{port}")

    def _wait_ready(self, name: str, timeout_s: float) -> None:
        section = getattr(self.config, name)

        def probe() -> bool:
            if _http_ok(f"{section.admin_url}/readyz"):
                return True
            error = _reported_error(section.admin_url, self.config.run.admin_token)
            if error:
                raise RiptideError(f"{name} failed while starting: {error}\n"
                                   f"last log lines:\n{self.log_tail(name)}")
            return False

        self._wait(probe, name, timeout_s)
        self.say(f"[up] {name:<10} ready  grpc {section.grpc_address}  admin {section.admin_url}")

    def _wait(self, probe: Callable[[], bool], name: str, timeout_s: float) -> None:
        process.wait_until_ready(probe, self.children[name], name, timeout_s,
                                 lambda: f"last log lines:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self._log(name)
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def dead_child(self) -> str | None:
        """The name of a child that exited, if any."""
        return next((n for n, c in self.children.items() if c.poll() is not None), None)

    def stop(self) -> None:
        """Stop the services in reverse start order, then Redis."""
        for name in reversed(list(self.children)):
            process.stop(self.children[name])
        self.children.clear()


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _reported_error(admin_url: str, token: str) -> str | None:
    """The `error` a starting service reports in its admin state, if it reports one."""
    try:
        resp = httpx.get(f"{admin_url}/admin/state", timeout=1.0,
                         headers={"Authorization": f"Bearer {token}"})
        details = resp.json().get("details") or {} if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    error = details.get("error") if isinstance(details, dict) else None
    return str(error) if error else None


def _redis_pings(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def run_up(run_dir: Path, config_path: Path | None, steps: int | None,
           summarize: Callable[[Any], str] | None = None) -> int:
    """The body of `riptide up`: start, wait for Ctrl-C / SIGTERM / `steps`, stop everything."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if config_path is None:
        config_path = run_dir / "config.toml"
        config_path.write_text(dump_config(local_config(run_dir)))
        os.chmod(config_path, 0o600)
        print(f"[up] tiny model {ensure_tiny_model(run_dir)}", flush=True)
    elif not config_path.exists():
        raise ConfigError(f"{config_path}: no such config file")
    print(f"[up] config {config_path}  logs {run_dir / 'logs'}", flush=True)
    stack = LocalStack(run_dir, config_path, say=lambda m: print(m, flush=True))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        stack.start()
        print("[up] all services ready; `riptide status --config "
              f"{config_path}` shows their state; Ctrl-C stops the stack", flush=True)
        return _supervise(stack, steps, summarize)
    except KeyboardInterrupt:
        print("\n[up] stopping", flush=True)
        return 130
    finally:
        stack.stop()
        print("[up] stopped", flush=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _supervise(stack: LocalStack, steps: int | None,
               summarize: Callable[[Any], str] | None) -> int:
    while True:
        dead = stack.dead_child()
        if dead is not None:
            print(f"[up] {dead} exited unexpectedly; last log lines:\n{stack.log_tail(dead)}",
                  flush=True)
            return 1
        if steps is not None and trainer_step(stack.config) >= steps:
            if summarize is not None:
                print(summarize(stack.config), flush=True)
            return 0
        time.sleep(1.0)


def trainer_step(config: Any) -> int:
    """The trainer's step from its admin state (-1 while it cannot say)."""
    headers = {"Authorization": f"Bearer {config.run.admin_token}"}
    try:
        state = httpx.get(f"{config.trainer.admin_url}/admin/state", headers=headers,
                          timeout=2.0).json()
    except (httpx.HTTPError, ValueError):
        return -1
    return int((state.get("details") or {}).get("step", -1))
