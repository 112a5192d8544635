"""Run a deployment's `srun` steps inside a Slurm job and restart the ones that fail.

Started once per job on the head node (by `python -m services.slurm`, from a batch script).
Starts the steps of steps.py in order, each once the one before is ready; then watches them:
a step that exits while the job runs is started again (its service resumes from its own
state: the trainer from its checkpoint, Redis from its append-only file), at most
`slurm.max_restarts` times. Ends when the trainer reached `trainer.max_steps` (exit 0; in the
rollout's score mode: when the rollout step exited 0 with its result file), when a step failed
too often (exit 1), or on SIGTERM/SIGINT (scancel), stopping every step.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from services.common import process
from services.common.errors import ConfigError
from services.local_stack import trainer_step
from services.slurm.steps import Step, deployment_steps, engine_key_file


@dataclass
class _Running:
    step: Step
    proc: subprocess.Popen[bytes]
    num_restarts: int = 0


def _ready(url: str, verify: ssl.SSLContext | bool = True) -> bool:
    parts = urlsplit(url)
    if parts.scheme == "tcp":
        try:
            with socket.create_connection((parts.hostname or "", parts.port or 0), timeout=1.0):
                return True
        except OSError:
            return False
    try:
        return httpx.get(url, timeout=2.0, verify=verify).status_code == 200
    except httpx.HTTPError:
        return False


def _step_env(step: Step) -> dict[str, str]:
    env = {**os.environ, **step.env}
    for name, path in step.env_files.items():
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"slurm.sandbox_env_files.{name}: no such file {path}")
        if file.stat().st_mode & 0o077:
            raise ConfigError(f"slurm.sandbox_env_files.{name}: {path} is readable by others; "
                              f"chmod 600 it")
        env[name] = file.read_text().strip()
    return env


class Supervisor:
    """The job's steps as child `srun` processes."""

    def __init__(self, config: Any, config_path: Path,
                 say: Callable[[str], None] = lambda m: print(m, flush=True)) -> None:
        self.config = config
        self.steps = deployment_steps(config, config_path)
        self.log_dir = Path(config.slurm.log_dir)
        self.say = say
        self.running: dict[str, _Running] = {}
        self.stopping = False

    def _start(self, step: Step) -> subprocess.Popen[bytes]:
        argv = step.srun_argv(self.log_dir, self.config.slurm.srun_args)
        return process.spawn(argv, log_path=self.log_dir / f"{step.name}.srun.log",
                             env=_step_env(step))

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        Path(self.config.slurm.redis_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        self._write_secret_files()
        for step in self.steps:
            self.say(f"[slurm] start {step.name} on {','.join(step.nodes)}")
            self.running[step.name] = _Running(step, self._start(step))
            self._wait_ready(step)
            self.say(f"[slurm] {step.name} ready")

    def _write_secret_files(self) -> None:
        """The SGLang engines' API key file, in a folder of this user only."""
        s = self.config.slurm
        if not (s.engine_nodes and s.engine_program == "sglang"):
            return
        from services.rollout.sglang_command import write_api_key_yaml

        path = engine_key_file(self.config)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        write_api_key_yaml(path, self.config.run.engine_api_key)

    def _wait_ready(self, step: Step) -> None:
        proc = self.running[step.name].proc
        done = lambda: proc.poll() is not None and scoring_done(  # noqa: E731
            self.config, step.name, proc.returncode)  # scored before the probe saw it ready
        process.wait_until_ready(
            lambda: self.stopping or _ready(step.ready_url, self.config.run.http_verify)
            or done(), proc,
            f"step {step.name}", self.config.slurm.ready_timeout_s,
            lambda: f"probed {step.ready_url}; see {self.log_dir / step.name}.log", 0.5)

    def watch(self) -> int:
        """Restart failed steps until the trainer is done (0), a step gave up (1) or stop.
        In score mode the rollout step is done when it exits 0 with its result written."""
        max_steps = self.config.trainer.max_steps
        while not self.stopping:
            for entry in self.running.values():
                code = entry.proc.poll()
                if code is None or self.stopping:
                    continue
                if scoring_done(self.config, entry.step.name, code):
                    self.say(f"[slurm] scoring done: {self.config.rollout.eval.result_path}")
                    return 0
                if entry.num_restarts >= self.config.slurm.max_restarts:
                    self.say(f"[slurm] {entry.step.name} exited with {code} after "
                             f"{entry.num_restarts} restarts; giving up")
                    return 1
                entry.num_restarts += 1
                self.say(f"[slurm] {entry.step.name} exited with {code}; restart "
                         f"{entry.num_restarts} of {self.config.slurm.max_restarts}")
                time.sleep(self.config.slurm.restart_delay_s)
                entry.proc = self._start(entry.step)
            if max_steps and self.config.rollout.mode == "train" \
                    and trainer_step(self.config) >= max_steps:
                self.say(f"[slurm] trainer reached {max_steps} steps")
                return 0
            time.sleep(1.0)
        return 130

    def stop(self) -> None:
        """SIGTERM every step, the trainer first (its last checkpoint and sync need the
        others), then the rest last started first; SIGKILL what outlives the grace period."""
        self.stopping = True
        names = sorted(reversed(list(self.running)), key=lambda n: n != "trainer")
        for name in names:
            self.say(f"[slurm] stop {name}")
            process.stop(self.running[name].proc, grace_s=self.config.slurm.stop_grace_s)
        self.running.clear()


def scoring_done(config: Any, step_name: str, exit_code: int) -> bool:
    """Whether a score-mode deployment's rollout step ended its one evaluation."""
    result = config.rollout.eval.result_path
    return (config.rollout.mode == "score" and step_name == "rollout" and exit_code == 0
            and result is not None and Path(result).is_file())


def run(config: Any, config_path: Path) -> int:
    """Start, watch and stop a deployment's steps; the exit code of the whole job."""
    supervisor = Supervisor(config, config_path)

    def on_signal(signum: int, frame: object) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        supervisor.start()
        return supervisor.watch()
    finally:
        supervisor.stop()
