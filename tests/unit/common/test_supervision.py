"""The supervisor restarts dead children with doubling backoff and gives up when one keeps
dying; real (short-lived) processes, a hand-driven clock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common import process
from services.common.supervision import GaveUp, RestartPolicy, Supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _dies() -> subprocess.Popen[bytes]:
    proc = process.spawn([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(30)
    return proc


def test_a_dead_child_is_restarted_after_a_doubling_backoff() -> None:
    clock = Clock()
    sup = Supervisor(RestartPolicy(initial_backoff_s=1.0, max_backoff_s=4.0, max_failures=10,
                                   window_s=100.0), clock)
    sup.add("svc", _dies)
    waits = []
    for _ in range(4):
        (died,) = sup.check()
        assert died.kind == "died" and "exit code 3" in died.detail
        restart_at = sup.children["svc"].restart_at
        assert restart_at is not None
        waits.append(restart_at - clock.now)
        clock.now = restart_at - 0.01
        assert sup.check() == []  # not before its backoff
        clock.now = restart_at
        (restarted,) = sup.check()
        assert restarted.kind == "restarted"
    assert waits == [1.0, 2.0, 4.0, 4.0] and sup.children["svc"].restarts == 4


def test_it_gives_up_after_max_failures_within_the_window_naming_the_child() -> None:
    clock = Clock()
    sup = Supervisor(RestartPolicy(initial_backoff_s=1.0, max_failures=2, window_s=100.0), clock)
    sup.add("trainer", _dies)
    for _ in range(2):
        sup.check()
        clock.now += 10
        sup.check()
    with pytest.raises(GaveUp, match=r"trainer died 3 times within 100s .*exit codes \[3, 3, 3\]"):
        sup.check()


def test_a_child_that_ran_a_whole_window_starts_from_the_first_backoff_again() -> None:
    clock = Clock()
    sup = Supervisor(RestartPolicy(initial_backoff_s=1.0, max_failures=2, window_s=100.0), clock)
    sup.add("router", _dies)
    sup.check()
    clock.now += 1
    sup.check()  # restarted at t=1
    clock.now += 500  # it "ran" 500 s before this death was noticed
    (died,) = sup.check()
    assert "restarting in 1.0s (failure 1 of" in died.detail


def test_a_live_child_is_left_alone_and_stop_all_stops_it() -> None:
    sup = Supervisor()
    proc = sup.add("sleeper", lambda: process.spawn(["sleep", "60"]))
    assert sup.check() == []
    sup.stop_all()
    assert proc.poll() is not None and sup.children == {}


def test_stop_all_gives_each_child_its_grace_before_the_kill(tmp_path: Path) -> None:
    """A child that needs a second after SIGTERM to finish (as the trainer checkpoints) is
    killed under a short grace and finishes under a longer one."""
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), "
              "open(sys.argv[1], 'w').write('done'), sys.exit(0)))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    for name, grace_s in (("killed", 0.2), ("finished", 20.0)):
        sup = Supervisor()
        marker = tmp_path / name
        proc = sup.add(name, lambda m=marker: subprocess.Popen(  # type: ignore[misc]
            [sys.executable, "-c", script, str(m)], stdout=subprocess.PIPE,
            start_new_session=True))
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        sup.stop_all(grace_s={name: grace_s})
        assert marker.exists() == (name == "finished"), name


def test_a_configuration_error_exit_is_not_restarted() -> None:
    def bad_config() -> subprocess.Popen[bytes]:
        proc = process.spawn([sys.executable, "-c", "raise SystemExit(2)"])
        proc.wait(30)
        return proc

    sup = Supervisor()
    sup.add("sandbox", bad_config)
    with pytest.raises(GaveUp, match="sandbox exited with code 2, an error a restart cannot fix"):
        sup.check()
