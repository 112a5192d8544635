"""Soak: the supervised local stack (`riptide up`) for M minutes under a seeded fault schedule.

The first `--baseline-frac` of the time runs without faults (the baseline: trainer steps per
minute and each service's memory); then every `--interval-s` one fault from FAULT_KINDS is
injected (a seeded shuffle, so every kind comes once before any comes twice). After each,
recovery is the time until the trainer took its next step. Every second the trainer's last
step's staleness and each process's RSS are sampled. At the end the faults stop, the run takes
one more step and services/testing/fault_stack.py's audit compares the groups produced
(Redis markers), still in the stream, trained (checkpoint) and dropped with reasons.

Usage: python bench/soak.py [--minutes 5] [--seed 0] [--interval-s auto] [--dir D]
Last line: {"produced": ..., "trained": ..., "dropped": {...}, "lost": 0, "duplicated": 0,
            "faults_injected": {...}, "recovery_s_max": ..., "staleness_max": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.local_stack import MAX_STALENESS
from services.testing.fault_stack import FaultStack

PROCESSES = ("router", "sandbox", "trainer", "rollout", "engine", "redis")
RECOVERY_BOUND_S = 180.0  # a fault the run has not recovered from in this long fails it


def fault_kinds(stack: FaultStack) -> dict[str, Callable[[], object]]:
    return {
        "router_sigkill": lambda: stack.kill("router"),
        "sandbox_sigkill": lambda: stack.kill("sandbox"),
        "rollout_sigkill": lambda: stack.kill("rollout"),
        "trainer_sigkill": lambda: stack.kill("trainer"),
        "engine_sigkill": lambda: stack.kill("engine"),
        "engine_hang": lambda: stack.hang_engine(30.0),  # detected after ~18 s
        "redis_restart": lambda: stack.kill("redis", signal.SIGTERM),
        "sandbox_failures": lambda: stack.fail_sandboxes(5.0),
        "trainer_during_sync": lambda: stack.kill_trainer_during_sync(60.0),
    }


class Sampler:
    """Per-second samples: the trainer's staleness and every process's RSS (per pid)."""

    def __init__(self, stack: FaultStack) -> None:
        self.stack = stack
        self.staleness_max = 0
        self.rss: dict[str, dict[int, list[float]]] = {p: {} for p in PROCESSES}

    def sample(self) -> None:
        last = self.stack.state("trainer").get("last_step") or {}
        self.staleness_max = max(self.staleness_max, int(last.get("staleness_max") or 0))
        for name in PROCESSES:
            pid = self.stack.pid(name)
            if pid is not None and (mb := _rss_mb(pid)) is not None:
                self.rss[name].setdefault(pid, []).append(mb)

    def rss_report(self) -> dict[str, Any]:
        """Per process: its longest-lived incarnation's first and last RSS and the growth."""
        out: dict[str, Any] = {}
        for name, by_pid in self.rss.items():
            if not by_pid:
                continue
            longest = max(by_pid.values(), key=len)
            out[name] = {"first_mb": round(longest[0], 1), "last_mb": round(longest[-1], 1),
                         "growth_mb": round(longest[-1] - longest[0], 1),
                         "samples": len(longest), "incarnations": len(by_pid)}
        return out


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _wait(stack: FaultStack, sampler: Sampler, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sampler.sample()
        time.sleep(max(0.0, min(1.0, end - time.monotonic())))


def _recover(stack: FaultStack, sampler: Sampler, step_before: int) -> float:
    start = time.monotonic()
    while time.monotonic() - start < RECOVERY_BOUND_S:
        if stack.step() > step_before:
            return time.monotonic() - start
        sampler.sample()
        time.sleep(0.5)
    return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval-s", type=float, default=None,
                        help="time between faults (default: every kind once in the run)")
    parser.add_argument("--baseline-frac", type=float, default=0.15)
    parser.add_argument("--dir", type=Path, default=None, help="run directory (default: temp)")
    args = parser.parse_args()
    run_dir = args.dir or Path(tempfile.mkdtemp(prefix="riptide-soak-"))
    stack = FaultStack(run_dir)
    rng = random.Random(args.seed)
    total_s = args.minutes * 60
    started = time.monotonic()
    stack.start()
    try:
        stack.wait_steps(1, 300)
        sampler = Sampler(stack)
        baseline_s = total_s * args.baseline_frac
        step0 = stack.step()
        _wait(stack, sampler, baseline_s)
        baseline_rate = (stack.step() - step0) / (baseline_s / 60)
        kinds = fault_kinds(stack)
        left = total_s - (time.monotonic() - started)
        interval = args.interval_s or max(20.0, left / len(kinds))
        order: list[str] = []
        recoveries: dict[str, list[float]] = {}
        fault_start_step = stack.step()
        fault_phase_start = time.monotonic()
        while time.monotonic() - started < total_s - 5:
            if not order:
                order = list(kinds)
                rng.shuffle(order)
            kind = order.pop()
            before = stack.step()
            kinds[kind]()
            recoveries.setdefault(kind, []).append(round(_recover(stack, sampler, before), 1))
            _wait(stack, sampler, max(0.0, min(interval - 1, total_s - (time.monotonic()
                                                                       - started) - 5)))
        fault_rate = (stack.step() - fault_start_step) / ((time.monotonic()
                                                           - fault_phase_start) / 60)
        stack.wait_steps(1, RECOVERY_BOUND_S)
        audit = stack.audit()
    finally:
        stack.stop()
    worst = max((r for rs in recoveries.values() for r in rs), default=0.0)
    result = {
        "minutes": args.minutes, "seed": args.seed, "interval_s": round(interval, 1),
        **{k: v for k, v in audit.as_dict().items() if k != "rollout_dropped"},
        "rollout_dropped_last_incarnation": audit.rollout_dropped,
        "faults_injected": {k: len(v) for k, v in recoveries.items()},
        "recovery_s": recoveries, "recovery_s_max": worst, "recovery_bound_s": RECOVERY_BOUND_S,
        "staleness_max": sampler.staleness_max, "staleness_bound": MAX_STALENESS,
        "steps_per_min_baseline": round(baseline_rate, 2),
        "steps_per_min_under_faults": round(fault_rate, 2),
        "rss": sampler.rss_report(),
        "ok": audit.lost == [] and audit.duplicated == [] and worst <= RECOVERY_BOUND_S
        and sampler.staleness_max <= MAX_STALENESS,
    }
    if args.dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
