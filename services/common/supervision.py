"""Restart dead child processes with backoff; give up after a bounded number of failures.

`Supervisor` owns named children, each started by a callable that returns a `Popen`. `check()`
(called periodically by its owner, `riptide up`) notices a child that exited, schedules its
restart after a backoff that doubles from `initial_backoff_s` to `max_backoff_s`, and restarts
it once the backoff has passed. A child that fails more than `max_failures` times within
`window_s` is not restarted again: `check()` raises `GaveUp` naming it, its exit codes and
the restarts so far; so does one that exits with a code in `fatal_exit_codes` (`riptide
serve` exits 2 on a configuration error, which a restart cannot fix). A child that stayed
up for `window_s` starts again from the initial backoff.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.common import process
from services.common.errors import RiptideError

log = logging.getLogger(__name__)

Spawn = Callable[[], "subprocess.Popen[bytes]"]


class GaveUp(RiptideError):
    """A child kept dying: the stack stops instead of restarting it forever."""


@dataclass(frozen=True)
class RestartPolicy:
    """How often a dead child is restarted."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_failures: int = 5
    window_s: float = 600.0
    fatal_exit_codes: tuple[int, ...] = (2,)


@dataclass
class Child:
    """One supervised process and its failure history."""

    name: str
    spawn: Spawn
    proc: subprocess.Popen[bytes]
    failures: deque[float] = field(default_factory=deque)  # monotonic times of deaths
    exit_codes: list[int] = field(default_factory=list)
    restarts: int = 0
    restart_at: float | None = None  # pending restart, monotonic
    started_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Event:
    """What `check()` did: a child died (and when it restarts) or was restarted."""

    name: str
    kind: str  # "died" or "restarted"
    detail: str


class Supervisor:
    """Named children restarted with backoff until one fails too often."""

    def __init__(self, policy: RestartPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy or RestartPolicy()
        self.children: dict[str, Child] = {}
        self._clock = clock

    def add(self, name: str, spawn: Spawn) -> subprocess.Popen[bytes]:
        proc = spawn()
        self.children[name] = Child(name, spawn, proc, started_at=self._clock())
        return proc

    def proc(self, name: str) -> subprocess.Popen[bytes]:
        return self.children[name].proc

    def check(self) -> list[Event]:
        """Notice deaths, restart children whose backoff passed; raises GaveUp."""
        now, events = self._clock(), []
        for child in self.children.values():
            if child.restart_at is None and child.proc.poll() is not None:
                events.append(self._died(child, now))
            if child.restart_at is not None and now >= child.restart_at:
                child.proc = child.spawn()
                child.restarts += 1
                child.restart_at, child.started_at = None, now
                events.append(Event(child.name, "restarted", f"pid {child.proc.pid}, restart "
                                                             f"{child.restarts}"))
        return events

    def _died(self, child: Child, now: float) -> Event:
        code = child.proc.returncode
        child.exit_codes.append(code)
        if now - child.started_at >= self.policy.window_s:
            child.failures.clear()  # it ran well for a whole window: a fresh start
        child.failures.append(now)
        while child.failures and now - child.failures[0] > self.policy.window_s:
            child.failures.popleft()
        if code in self.policy.fatal_exit_codes:
            raise GaveUp(f"{child.name} exited with code {code}, an error a restart cannot "
                         f"fix ({child.restarts} restarts before): giving up")
        if len(child.failures) > self.policy.max_failures:
            raise GaveUp(
                f"{child.name} died {len(child.failures)} times within "
                f"{self.policy.window_s:.0f}s (exit codes {child.exit_codes[-6:]}, "
                f"{child.restarts} restarts): giving up")
        backoff = min(self.policy.max_backoff_s,
                      self.policy.initial_backoff_s * 2 ** (len(child.failures) - 1))
        child.restart_at = now + backoff
        return Event(child.name, "died", f"exit code {code}; restarting in {backoff:.1f}s "
                                         f"(failure {len(child.failures)} of at most "
                                         f"{self.policy.max_failures} in "
                                         f"{self.policy.window_s:.0f}s)")

    def stop_all(self, order: list[str] | None = None,
                 grace_s: Mapping[str, float] | None = None) -> None:
        """Stop the children named in `order` (default: every one, reverse of adding) by
        process group, each given `grace_s[name]` (default 10 s) between SIGTERM and
        SIGKILL; the others keep running and stay supervised."""
        names = list(reversed(self.children)) if order is None else order
        for name in names:
            process.stop(self.children.pop(name).proc, (grace_s or {}).get(name, 10.0))

    def state(self) -> dict[str, dict[str, object]]:
        return {c.name: {"pid": c.proc.pid, "restarts": c.restarts,
                         "exit_codes": list(c.exit_codes)} for c in self.children.values()}
