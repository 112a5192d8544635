"""`riptide up` under faults: the supervised local stack, ways to hurt it, and an audit.

`FaultStack` runs `riptide up --dir D --config D/config.toml` as a child (the real stack:
Redis, four services, the engine), finds each process by its command line, and injects
faults: SIGKILL of a service, the engine or Redis (append-only, fsync on every write, so the
supervisor's restart finds every acknowledged write), a hung engine (SIGSTOP), failing sandbox
creation (the local provider's `fail_create_while` flag file: creates fail as on an unhealthy
host), a trainer killed during a weight sync. `audit()` compares the group ids produced (the Redis
dedup markers: every group written to the stream), still in the stream, trained (the newest
checkpoint) and dropped with a reason, and counts lost and duplicated groups. Used by
tests/faults and bench/soak.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from services.common import process
from services.common.config import dump_config
from services.common.redis_connect import connect
from services.local_stack import MAX_STALENESS, ensure_tiny_model, local_config
from services.testing.proc_tree import descendants, is_running

SERVICES = ("router", "sandbox", "trainer", "rollout")


@dataclass
class Audit:
    """Where every produced group ended up."""

    produced: int
    trained: int
    dropped: dict[str, int]
    in_stream: int
    lost: list[str]
    duplicated: list[str]
    trained_and_dropped: list[str]
    rollout_dropped: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["lost"], out["duplicated"] = len(self.lost), len(self.duplicated)
        out["trained_and_dropped"] = len(self.trained_and_dropped)
        return out


def fault_settings(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The local stack's settings for fault runs: a hung engine is found within ~18 s, an
    engine may restart often, an update waits at most 20 s on one, and a step needs 4
    episodes (groups of 2) instead of 8."""
    return {"rollout": {
        "fleet": {"kind": "builtin", "num_engines": 1, "model_path": str(run_dir / "model"),
                  "log_dir": str(run_dir / "logs"), "start_timeout_s": 120.0,
                  "health_interval_s": 1.0, "max_missed_health_checks": 3,
                  "max_restarts": 1000},
        "weight_update": {"step_timeout_s": 20.0},
        "scheduler": {"max_concurrent_samples": 8, "n_samples_per_prompt": 2,
                      "num_groups_per_batch": 2, "max_new_tokens": 32, "temperature": 1.0,
                      "max_staleness": MAX_STALENESS},
    }}


class FaultStack:
    """The local stack as a child of this process, with fault injection."""

    def __init__(self, run_dir: Path, overrides: dict[str, dict[str, Any]] | None = None) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        ensure_tiny_model(run_dir)
        self.flag = run_dir / "fail-sandbox-creation"
        settings: dict[str, dict[str, Any]] = {
            "sandbox": {"provider": {"type": "local", "fail_create_while": str(self.flag)}},
        }
        for section, values in (fault_settings(run_dir) if overrides is None
                                else overrides).items():
            settings.setdefault(section, {}).update(values)
        self.config = local_config(run_dir, settings)
        self.config_path = run_dir / "config.toml"
        self.config_path.write_text(dump_config(self.config))
        self.config_path.chmod(0o600)  # it holds the admin token
        self.log = run_dir / "up.log"
        self.up: subprocess.Popen[bytes] | None = None
        self.faults: Counter[str] = Counter()
        self.run = self.config.run.name

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> None:
        self.up = process.spawn([sys.executable, "-m", "services.cli", "up", "--dir",
                                 str(self.run_dir), "--config", str(self.config_path)],
                                log_path=self.log)
        self.wait_for(lambda: "all services ready" in self.log_text(), timeout_s, "ready")

    def stop(self) -> int | None:
        """Ctrl-C, as a person stops it (the trainer checkpoints what it trained)."""
        if self.up is None:
            return None
        if self.up.poll() is None:
            self.up.send_signal(signal.SIGINT)
            try:
                self.up.wait(120)
            except subprocess.TimeoutExpired:
                pass
        code = process.stop(self.up)
        self.flag.unlink(missing_ok=True)
        return code

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
        """Seconds until `predicate()` held; AssertionError with the log if it never did."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if predicate():
                return time.monotonic() - start
            if self.up is not None and self.up.poll() is not None:
                raise AssertionError(f"riptide up exited ({self.up.returncode}) waiting for "
                                     f"{what}:\n{self.log_text()[-4000:]}")
            time.sleep(0.25)
        raise AssertionError(f"no {what} within {timeout_s:.0f}s:\n{self.log_text()[-4000:]}"
                             f"\n{self.diagnosis()}")

    def diagnosis(self) -> str:
        """What each service says now and the last lines of its own log: what a timeout
        needs to be understood from a CI log alone (the run directory is gone there)."""
        parts = []
        for name in SERVICES:
            state = json.dumps(self.state(name), default=str)[:3000]
            log_path = self.run_dir / "logs" / f"{name}.log"
            lines = (log_path.read_text(errors="replace").splitlines()[-25:]
                     if log_path.exists() else [])
            parts.append(f"--- {name} (pid {self.pid(name)}) state: {state}\n"
                         f"--- {name} log tail:\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- looking at it -----------------------------------------------------------------
    def state(self, name: str) -> dict[str, Any]:
        """The service's /admin/state details ({} while it does not answer)."""
        section = getattr(self.config, name)
        try:
            reply = httpx.get(f"{section.admin_url}/admin/state", timeout=3.0,
                              headers={"Authorization": f"Bearer {self.config.run.admin_token}"})
            return dict(reply.json().get("details") or {}) if reply.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def lifecycle(self, name: str) -> str | None:
        section = getattr(self.config, name)
        try:
            reply = httpx.get(f"{section.admin_url}/admin/state", timeout=3.0,
                              headers={"Authorization": f"Bearer {self.config.run.admin_token}"})
            return str(reply.json().get("state")) if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def step(self) -> int:
        return int(self.state("trainer").get("step", -1))

    def pid(self, name: str) -> int | None:
        """The pid of a service, `engine` or `redis` below `riptide up` (None: not running)."""
        assert self.up is not None
        needle = {"engine": "services.engine", "redis": "redis-server"}.get(name)
        for pid in sorted(descendants(self.up.pid)):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in argv]
            if needle is not None and any(needle in w for w in words[:3]):
                return pid
            if needle is None and "serve" in words and name in words \
                    and words.index(name) == words.index("serve") + 1:
                return pid
        return None

    def wait_steps(self, more: int, timeout_s: float) -> float:
        """Seconds until the trainer took `more` steps beyond the present one."""
        target = max(self.step(), 0) + more
        return self.wait_for(lambda: self.step() >= target, timeout_s, f"trainer step {target}")

    # -- faults ------------------------------------------------------------------------
    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> int:
        """Signal the process group of a service, the engine or Redis; returns the pid."""
        pid = None
        deadline = time.monotonic() + 120
        while pid is None:  # it may be restarting right now
            pid = self.pid(name)
            if pid is None:
                assert time.monotonic() < deadline, f"{name} is not running"
                time.sleep(0.5)
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        self.faults[f"{name}:{sig.name}"] += 1
        return pid

    def hang_engine(self, at_most_s: float) -> int:
        """SIGSTOP the engine until the fleet kills it as hung (SIGCONT after `at_most_s` if
        it never does); returns its pid. Raises if the signal did not stop it."""
        pid = self.kill("engine", signal.SIGSTOP)
        self.faults["engine:hang"] += 1
        self.faults["engine:SIGSTOP"] -= 1
        if not _holds_within(lambda: _state_of(pid) in ("T", None), 5):
            raise AssertionError(f"engine {pid} is not stopped after SIGSTOP "
                                 f"(state {_state_of(pid)})")
        try:
            _holds_within(lambda: not is_running(pid), at_most_s)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        return pid

    def fail_sandboxes(self, seconds: float, until_one_s: float = 90.0) -> int:
        """Every sandbox creation fails for `seconds`, and on until one creation did fail (at
        most `until_one_s` more: the rollout may be waiting on the trainer, creating none).
        Returns the creations that failed meanwhile, as the sandbox service counted them."""
        def failures() -> int:
            return int(self.state("sandbox").get("create_failures") or 0)

        before = failures()
        self.flag.touch()
        self.faults["sandbox:create_failing"] += 1
        try:
            time.sleep(seconds)
            deadline = time.monotonic() + until_one_s
            while failures() <= before and time.monotonic() < deadline:
                time.sleep(0.25)
        finally:
            self.flag.unlink(missing_ok=True)
        return failures() - before

    def kill_trainer_during_sync(self, timeout_s: float = 120.0) -> bool:
        """SIGKILL the trainer while a weight update is in progress; False if none was seen
        in time (it is killed anyway)."""
        deadline = time.monotonic() + timeout_s
        caught = False
        while time.monotonic() < deadline:
            updates = self.state("rollout").get("weight_updates") or {}
            if updates.get("in_progress"):
                caught = True
                break
            time.sleep(0.02)
        self.kill("trainer")
        self.faults["trainer:during_sync"] += 1
        self.faults["trainer:SIGKILL"] -= 1
        return caught

    # -- audit -------------------------------------------------------------------------
    def redis(self) -> redis.Redis:
        return connect(self.config.redis, socket_timeout=10)

    def audit(self) -> Audit:
        """Markers, then the stream, then the newest checkpoint (that order never reports a
        group as lost that was trained meanwhile: a group leaves the stream only after the
        checkpoint holding it is durable)."""
        client = self.redis()
        prefix = f"riptide:{self.run}:group:"
        produced = {k.decode()[len(prefix):] for k in client.scan_iter(f"{prefix}*", count=1000)}
        stream: Any = client.xrange(f"riptide:{self.run}:samples")
        in_stream = {fields[b"group_id"].decode() for _, fields in stream}
        state = _newest_checkpoint_state(Path(self.config.trainer.checkpoint.dir))
        trained = state.get("trained_group_ids", [])
        dropped = state.get("dropped_groups", {})
        counts = Counter(trained)
        return Audit(
            produced=len(produced), trained=len(set(trained)),
            dropped=dict(Counter(dropped.values())), in_stream=len(in_stream),
            lost=sorted(produced - in_stream - set(trained) - set(dropped)),
            duplicated=sorted(g for g, n in counts.items() if n > 1),
            trained_and_dropped=sorted(set(trained) & set(dropped)),
            rollout_dropped=dict((self.state("rollout").get("scheduler") or {})
                                 .get("dropped_groups") or {}),
        )


def _holds_within(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def _state_of(pid: int) -> str | None:
    """The process's state letter from /proc (T: stopped, Z: zombie); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state = stat[stat.rindex(")") + 2]
    return None if state in ("Z", "X") else state


def _newest_checkpoint_state(directory: Path) -> dict[str, Any]:
    while True:  # the trainer may delete an old checkpoint while this reads it
        steps = sorted(directory.glob("step-*"))
        if not steps:
            return {}
        try:
            return dict(json.loads((steps[-1] / "trainer_state.json").read_text()))
        except FileNotFoundError:
            continue
