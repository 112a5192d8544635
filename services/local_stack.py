"""`riptide up`: Redis and the four services as child processes on loopback.

Writes the stack's config into a run directory, starts redis-server (append-only with an
fsync per write, so the stream survives even a SIGKILL) and every service with `riptide
serve` at once (each waits for the peers it calls, so start order does not matter), waits
until every one is ready, then supervises them: a child that dies is restarted with backoff
(services/common/supervision.py), and one that keeps dying stops the stack with a report.
Everything stops (process groups, no orphans) on Ctrl-C, on SIGTERM, on such a give-up, or
when the trainer reached `--steps` more steps (it is started with that step as its
`max_steps`: it trains, checkpoints and syncs it and reads no more, so the summary's steps are
the checkpoint's and the stop trains nothing beyond them).

A run directory that already holds a checkpoint is resumed: the trainer continues from it and
the stream in its Redis data; `riptide up` says which of the two it does. A config in the
rollout's score mode (`rollout.mode = "score"`) runs router, sandbox and rollout only, until
the rollout wrote its one evaluation to `rollout.eval.result_path`; `riptide up` prints it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from services.common import process
from services.common.checkpoint_steps import latest_checkpoint_step
from services.common.config import RedisConfig, deep_merge, dump_config
from services.common.errors import ConfigError, RiptideError, Unavailable
from services.common.ports import free_ports
from services.common.progress import StepProgress
from services.common.redis_connect import connect, pings
from services.common.redis_server_config import (
    CONFIG_NAME,
    describe_server,
    server_config,
    write_server_config,
)
from services.common.supervision import GaveUp, Supervisor
from services.deployment import load_config, validate_config
from services.rollout.dashboard.config import dashboard_url

if TYPE_CHECKING:
    from services.common.tracking.exporter import MetricsExporter

#: The services of the stack. They are started together; the order is only that of the logs.
SERVICE_ORDER = ("router", "sandbox", "trainer", "rollout")
# On SIGTERM the trainer finishes its step, its weight sync and a checkpoint of what it has
# not checkpointed (so the run's last steps survive a stop); for a real model that takes far
# longer than the 10 s other services get: at least this, more where its steps are slower
# (trainer_stop_grace_s).
TRAINER_STOP_GRACE_S = 180.0
#: The rollout's score mode: one evaluation of a model, no stream and no trainer.
SCORE_ORDER = ("router", "sandbox", "rollout")
REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_STALENESS = 4
LOOPBACK = "127.0.0.1"


def local_config(run_dir: Path, overrides: dict[str, dict[str, Any]] | None = None) -> Any:
    """A deployment config for one machine: loopback, free ports, fresh admin and gRPC tokens,
    engine API key and Redis password (the file is the only place they are written: children
    read them from it, not argv; the fleet hands the key to its engines in their environment,
    Redis gets the password's hash in its private redis.conf).

    `overrides` are merged at every depth (`{"trainer": {"model": {"hf_path": ...}}}` keeps
    the model's dtype); the trainer's sampling temperature follows the rollout's (deployment
    validation) unless an override sets it."""
    ports = iter(free_ports(2 + 2 * len(SERVICE_ORDER)))
    data: dict[str, Any] = {
        "run": {"name": "local", "admin_token": secrets.token_urlsafe(24),
                "grpc_token": secrets.token_urlsafe(24),
                "engine_api_key": secrets.token_urlsafe(24), "log_format": "json"},
        "redis": {"url": f"redis://127.0.0.1:{next(ports)}/0",
                  "password": secrets.token_urlsafe(32)},
    }
    for name in SERVICE_ORDER:
        data[name] = {"host": "127.0.0.1", "grpc_port": next(ports), "admin_port": next(ports)}
    data["router"]["http_port"] = next(ports)  # the agent gateway's way to the router
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
                          "temperature": 1.0, "max_staleness": MAX_STALENESS,
                          # A random model never scores: every group has zero variance.
                          "drop_zero_variance_groups": False},
            "fleet": {"kind": "builtin", "num_engines": 1, "model_path": model,
                      "log_dir": str(run_dir / "logs"), "start_timeout_s": 120.0},
            # A tiny model's update takes well under a second: a hung engine fails it fast.
            "weight_update": {"step_timeout_s": 60.0},
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
            "max_staleness": MAX_STALENESS,  # the backstop for what the rollout admits
            "model": {"hf_path": model, "dtype": "float32"},
            "optimizer": {"lr": 1e-4},
            "checkpoint": {"dir": str(run_dir / "checkpoints")},
            "weight_sync": {"dtype": "float32", "bucket_mb": 16.0, "retry_max_s": 5.0,
                            "check_interval_s": 2.0},
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
    """Redis plus the four services, each a supervised child process with its own log."""

    def __init__(self, run_dir: Path, config_path: Path,
                 say: Callable[[str], None] = print, supervisor: Supervisor | None = None,
                 max_steps: int | None = None) -> None:
        self.run_dir = run_dir
        self.config_path = config_path
        self.config = load_config(config_path)
        self.say = say
        self.supervisor = supervisor or Supervisor()
        #: The trainer's last step (its `max_steps`): it trains, checkpoints and syncs that
        #: step, then reads no more, so a stop never trains a step beyond it.
        self.max_steps = max_steps

    @property
    def children(self) -> dict[str, subprocess.Popen[bytes]]:
        return {name: c.proc for name, c in self.supervisor.children.items()}

    @property
    def scoring(self) -> bool:
        """The rollout's score mode: no Redis, no trainer; done when the rollout is."""
        return bool(self.config.rollout.mode == "score")

    def scored(self) -> bool:
        """Score mode: the rollout exited 0 with its result file written."""
        child = self.supervisor.children.get("rollout")
        result = self.config.rollout.eval.result_path
        return (self.scoring and child is not None and child.proc.poll() == 0
                and result is not None and Path(result).is_file())

    def start(self, ready_timeout_s: float = 300.0,
              order: tuple[str, ...] | None = None) -> None:
        """Redis, then every service at once (in `order`); returns when all are ready (in
        score mode: without Redis and the trainer, or once the scoring is done)."""
        if order is None:
            order = SCORE_ORDER if self.scoring else SERVICE_ORDER
        if not self.scoring:
            self._start_redis()
        for name in order:
            self.supervisor.add(name, lambda name=name: self._spawn(name))  # type: ignore[misc]
        deadline = time.monotonic() + ready_timeout_s
        waiting = list(order)
        while waiting and not self.scored():
            for name in list(waiting):
                if self._probe_ready(name):
                    waiting.remove(name)
                    section = getattr(self.config, name)
                    self.say(f"[up] {name:<10} ready  grpc {section.grpc_address}  "
                             f"admin {self.config.run.admin_url(section)}")
            self.check_children(starting=True)
            if waiting and time.monotonic() > deadline:
                name = waiting[0]
                raise RiptideError(f"{name} not ready after {ready_timeout_s:.0f}s; "
                                   f"last log lines:\n{self.log_tail(name)}")
            time.sleep(0.2)

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "services.cli", "serve", name,
               "--config", str(self.config_path)]
        if name == "trainer" and self.max_steps is not None:
            cmd += ["--set", f"trainer.max_steps={self.max_steps}"]
        return process.spawn(cmd, log_path=self._log(name), cwd=REPO_ROOT)

    def _log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise Unavailable(
                "redis-server is not on PATH. Install it (Debian/Ubuntu: "
                "`sudo apt-get install -y redis-server`; macOS: `brew install redis`) "
                "or run `make demo`, which installs it when run as root.")
        redis_config = self.config.redis
        cmd = redis_command(binary, redis_config, self.run_dir / "redis")
        self.supervisor.add("redis", lambda: process.spawn(cmd, log_path=self._log("redis")))
        deadline = time.monotonic() + 30.0
        while not pings(redis_config):
            proc = self.supervisor.proc("redis")
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RiptideError(f"redis did not start (exit code {proc.returncode}); "
                                   f"last log lines:\n{self.log_tail('redis')}")
            time.sleep(0.2)
        self.say(f"[up] redis      ready  {redis_config.host}:{redis_config.port}  "
                 f"{describe_server(redis_config, [LOOPBACK])}; clients log in with "
                 f"[redis] username and password of {self.config_path}")

    def _probe_ready(self, name: str) -> bool:
        run = self.config.run
        url = run.admin_url(getattr(self.config, name))
        if _http_ok(f"{url}/readyz", run.http_verify):
            return True
        error = _reported_error(url, run.admin_token, run.http_verify)
        if error:  # a service that reports a failure while starting will not get better
            raise RiptideError(f"{name} failed while starting: {error}\n"
                               f"last log lines:\n{self.log_tail(name)}")
        return False

    def check_children(self, starting: bool = False) -> None:
        """Restart dead children with backoff (raises GaveUp when one keeps dying)."""
        if self.scored():
            return  # the scoring rollout's exit is its end, not a death to restart
        try:
            events = self.supervisor.check()
        except GaveUp as exc:
            name = str(exc).split(" ", 1)[0]
            when = f"{name} failed while starting: " if starting else ""
            raise GaveUp(f"{when}{exc}; last log lines of {name}:\n{self.log_tail(name)}"
                         ) from None
        for event in events:
            when = " while starting" if starting else ""
            self.say(f"[up] {event.name} {event.kind}{when}: {event.detail}")
            if event.kind == "died":
                self.say(f"[up] last log lines of {event.name}:\n{self.log_tail(event.name, 8)}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self._log(name)
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Stop the services (the trainer first, while the engines it syncs to still run),
        save the run's events (while Redis still runs), then Redis."""
        order = ["trainer", *(n for n in reversed(SERVICE_ORDER) if n != "trainer")]
        names = [n for n in order if n in self.supervisor.children]
        grace = TRAINER_STOP_GRACE_S
        if "trainer" in names:
            grace = trainer_stop_grace_s(_trainer_details(self.config))
            if grace > TRAINER_STOP_GRACE_S:
                self.say(f"[up] stopping: the trainer has up to {grace:.0f} s to finish its "
                         "step and checkpoint (its last step took that long)")
        self.supervisor.stop_all(names, grace_s={"trainer": grace})
        if "redis" in self.supervisor.children and self.config.run.events.enabled:
            self.save_events()
        self.supervisor.stop_all()

    def save_events(self) -> None:
        """Write the run's events to <run dir>/events.jsonl, to reopen the run later."""
        import redis

        from services.common.events import export_events

        path = self.run_dir / "events.jsonl"
        client = connect(self.config.redis, socket_connect_timeout=2.0, socket_timeout=30.0)
        try:
            num_events, num_episodes = export_events(client, self.config.run.name, path)
        except redis.RedisError as exc:
            self.say(f"[up] events not saved: {exc}")
            return
        finally:
            client.close()
        self.say(f"[up] saved {num_events} events and {num_episodes} episodes to {path}")


def _http_ok(url: str, verify: ssl.SSLContext | bool = True) -> bool:
    try:
        return httpx.get(url, timeout=1.0, verify=verify).status_code == 200
    except httpx.HTTPError:
        return False


def redis_command(binary: str, config: RedisConfig, data_dir: Path) -> list[str]:
    """The stack's redis-server: loopback, the deployment's ACL user and password (from a
    private redis.conf in `data_dir`, written here), append-only, and an fsync of the log
    before each reply, so a SIGKILL (or a host crash) loses no write Redis acknowledged."""
    text = server_config(config, [LOOPBACK], data_dir.resolve(), appendfsync="always")
    return [binary, str(write_server_config(data_dir / CONFIG_NAME, text))]


def _reported_error(admin_url: str, token: str, verify: ssl.SSLContext | bool = True) -> str | None:
    """The `error` a starting service reports in its admin state, if it reports one."""
    try:
        resp = httpx.get(f"{admin_url}/admin/state", timeout=1.0, verify=verify,
                         headers={"Authorization": f"Bearer {token}"})
        details = resp.json().get("details") or {} if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    error = details.get("error") if isinstance(details, dict) else None
    return str(error) if error else None


def run_up(run_dir: Path, config_path: Path | None, steps: int | None,
           summarize: Callable[[Any], str] | None = None,
           overrides: dict[str, dict[str, Any]] | None = None) -> int:
    """The body of `riptide up`: start or resume, supervise until Ctrl-C / SIGTERM /
    `steps` more trainer steps / a child that keeps dying, then stop everything. Without
    `config_path` a local config is written (with `overrides`; the tiny model unless they
    name another)."""
    # SIGINT too: Python installs its Ctrl-C handler only where SIGINT was not ignored at
    # start, and a shell starts background jobs with it ignored (`riptide up &`).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    run_dir.mkdir(parents=True, exist_ok=True)
    if config_path is None:
        config_path = run_dir / "config.toml"
        config = local_config(run_dir, overrides)
        config_path.write_text(dump_config(config))
        os.chmod(config_path, 0o600)
        if config.trainer.model.hf_path == str(run_dir / "model"):
            print(f"[up] tiny model {ensure_tiny_model(run_dir)}", flush=True)
        else:
            print(f"[up] model {config.trainer.model.hf_path}", flush=True)
    elif not config_path.exists():
        raise ConfigError(f"{config_path}: no such config file")
    print(f"[up] config {config_path}  logs {run_dir / 'logs'}", flush=True)
    stack = LocalStack(run_dir, config_path, say=lambda m: print(m, flush=True))
    if stack.scoring:
        return _run_score(stack)
    progress = None
    try:
        resumed_step = _announce_run(stack)
        target = None if steps is None else resumed_step + steps
        stack.max_steps = target
        if stack.config.run.events.enabled:
            progress = StepProgress(stack.config.redis, stack.config.run.name, target,
                                    _exporter(stack))
        stack.start()
        print("[up] all services ready; `riptide status --config "
              f"{config_path}` shows their state; Ctrl-C stops the stack", flush=True)
        rollout = stack.config.rollout
        if rollout.dashboard.enabled:
            url = dashboard_url(rollout.host, rollout.admin_port, stack.config.run.admin_token)
            print(f"[up] dashboard {url}", flush=True)
        if target is not None and resumed_step:
            print(f"[up] --steps {steps}: training until step {target}", flush=True)
        return _supervise(stack, target, summarize, progress)
    except KeyboardInterrupt:
        print("\n[up] stopping", flush=True)
        return 130
    finally:
        stack.stop()
        if progress is not None:
            progress.close()
        print("[up] stopped", flush=True)


def _exporter(stack: LocalStack) -> MetricsExporter | None:
    """The live metrics export of `[run.tracking]` (None when off); W&B files in the run dir."""
    tracking = stack.config.run.tracking
    if not tracking.enabled:
        return None
    from services.common.tracking.exporter import MetricsExporter

    exporter = MetricsExporter.from_config(tracking, stack.config.run.name, stack.run_dir)
    targets = [t for t in (tracking.tensorboard_dir and f"TensorBoard {tracking.tensorboard_dir}",
                           tracking.wandb_project and f"W&B {tracking.wandb_project} "
                           f"({tracking.wandb_mode})") if t]
    print(f"[up] exporting metrics to {', '.join(targets)}", flush=True)
    return exporter


def _run_score(stack: LocalStack) -> int:
    """Score mode: router, sandbox and rollout until the rollout wrote its result; prints it."""
    result = Path(stack.config.rollout.eval.result_path)
    result.unlink(missing_ok=True)  # done means this run's result, never a previous one
    print(f"[up] scoring {stack.config.rollout.fleet.model_path or 'the attached engines'} "
          f"(rollout.mode = score); result {result}", flush=True)
    try:
        stack.start()
        while not stack.scored():
            stack.check_children()
            time.sleep(0.5)
        print(result.read_text().rstrip(), flush=True)
        return 0
    except KeyboardInterrupt:
        print("\n[up] stopping", flush=True)
        return 130
    finally:
        stack.stop()
        print("[up] stopped", flush=True)


def _announce_run(stack: LocalStack) -> int:
    """Say whether this is a fresh run or the resumption of one; returns the resumed step."""
    ckpt_dir = Path(stack.config.trainer.checkpoint.dir)
    step = latest_checkpoint_step(ckpt_dir)
    saved = any((stack.run_dir / "redis" / n).exists() for n in ("appendonlydir", "appendonly.aof"))
    if step:
        stream = "its stream" if saved else "no saved stream"
        print(f"[up] resuming the run in {stack.run_dir}: trainer checkpoint at step {step} "
              f"({ckpt_dir}), {stream} in {stack.run_dir / 'redis'}", flush=True)
    else:
        print(f"[up] starting a fresh run in {stack.run_dir} (no checkpoint in {ckpt_dir})",
              flush=True)
    return step


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _supervise(stack: LocalStack, target_step: int | None,
               summarize: Callable[[Any], str] | None,
               progress: StepProgress | None = None) -> int:
    def print_progress() -> None:
        for line in progress.poll() if progress is not None else ():
            print(line, flush=True)

    while True:
        stack.check_children()
        print_progress()
        if target_step is not None and trainer_finished(stack.config, target_step):
            time.sleep(0.5)  # the last step's event is on its way (the publisher batches)
            print_progress()
            if summarize is not None:
                print(summarize(stack.config), flush=True)
            return 0
        time.sleep(1.0)


def _trainer_details(config: Any) -> dict[str, Any]:
    """The trainer's admin state details ({} while it cannot say)."""
    headers = {"Authorization": f"Bearer {config.run.admin_token}"}
    try:
        state = httpx.get(f"{config.run.admin_url(config.trainer)}/admin/state",
                          headers=headers, timeout=2.0, verify=config.run.http_verify).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return dict(state.get("details") or {})


def trainer_stop_grace_s(details: dict[str, Any]) -> float:
    """Seconds between the trainer's SIGTERM and its SIGKILL: enough to finish the step in
    progress, sync it and checkpoint what is not yet checkpointed, judged by its last step
    (twice it, plus a minute), and never less than TRAINER_STOP_GRACE_S. On a slow machine a
    fixed grace would kill a step in progress and lose every step since the last checkpoint."""
    last = details.get("last_step") or {}
    try:
        seconds = sum(float(last.get(key) or 0.0)
                      for key in ("step_s", "weight_sync_s", "checkpoint_s"))
    except (TypeError, ValueError):
        seconds = 0.0
    return max(TRAINER_STOP_GRACE_S, 2 * seconds + 60.0)


def trainer_step(config: Any) -> int:
    """The trainer's step from its admin state (-1 while it cannot say)."""
    return int(_trainer_details(config).get("step", -1))


def trainer_finished(config: Any, max_steps: int) -> bool:
    """Whether the trainer's loop ended at its `max_steps`: that step is trained,
    checkpointed and synced, and nothing beyond it will be."""
    details = _trainer_details(config)
    return int(details.get("step", -1)) >= max_steps and details.get("phase") == "stopped"
