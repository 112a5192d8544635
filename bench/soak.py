"""Soak: the supervised local stack (`riptide up`) for M minutes under a seeded fault schedule.

The first `--baseline-frac` of the time runs without faults (the baseline: trainer steps per
minute and each service's memory); then every `--interval-s` one fault from `fault_kinds` is
injected (a seeded shuffle, so every kind comes once before any comes twice): SIGKILL of each
service, of the engine and of Redis (append-only, fsync per write), a hung engine, sandbox
creation failing (the local provider's fault hook), the trainer killed during a weight sync.
After each, recovery is the time until the trainer took its next step; the run fails if one
takes longer than RECOVERY_BOUND_S. Every second the trainer's last step's staleness and each
process's RSS are sampled. A process's memory is measured per incarnation (pid) from a
baseline taken `--warmup-s` after it reported ready (a service's /admin/state, the engine's
fleet entry), not while it imports torch and loads its model; its growth is the largest
(last - baseline) over its incarnations, and the growth over the later half of its longest
measured incarnation tells warm-up from a leak. At the end the faults stop, the run takes one more
step and services/testing/fault_stack.py's audit compares the groups produced (Redis
markers), still in the stream, trained (checkpoint) and dropped with reasons. From the run's
events (every incarnation's): episodes without verdict by cause (`rollout.episode`), and
the sandboxes the reaper deleted after the sandbox service's kills, by reason
(`sandbox.reap`).

Usage: python bench/soak.py [--minutes 5] [--seed 0] [--interval-s auto] [--warmup-s 15]
                            [--dir D]
Last line: {"produced": ..., "trained": ..., "dropped": {...}, "lost": 0, "duplicated": 0,
            "faults_injected": {...}, "recovery_s_max": ..., "staleness_max": ...,
            "no_verdict_by_cause": {...}, "sandboxes_reaped": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.events import iter_events
from services.common.progress import StepProgress
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
        "engine_hang": lambda: stack.hang_engine(120.0),  # killed as hung after ~18 s
        "redis_restart": lambda: stack.kill("redis", signal.SIGKILL),  # restarted on its AOF
        "sandbox_failures": lambda: stack.fail_sandboxes(5.0),  # creation fails (returns count)
        "trainer_during_sync": lambda: stack.kill_trainer_during_sync(60.0),
    }


@dataclass
class Incarnation:
    """One pid of a process: when it was ready, its RSS baseline after the warm-up, its last."""

    ready_at: float | None = None
    baseline_mb: float | None = None
    last_mb: float | None = None
    samples: int = 0
    after_baseline: list[float] = field(default_factory=list)  # every sample from the baseline

    @property
    def second_half_growth_mb(self) -> float:
        """Growth over the later half of its measured life: near 0 once caches are warm; a
        leak keeps it growing."""
        half = self.after_baseline[len(self.after_baseline) // 2:]
        return half[-1] - half[0] if half else 0.0

    @property
    def growth_mb(self) -> float | None:
        if self.baseline_mb is None or self.last_mb is None:
            return None
        return self.last_mb - self.baseline_mb


class Sampler:
    """Per-second samples: the trainer's staleness and every process's RSS (per pid, from a
    baseline taken `warmup_s` after that pid reported ready)."""

    def __init__(self, stack: FaultStack, warmup_s: float, progress: StepProgress) -> None:
        self.stack = stack
        self.warmup_s = warmup_s
        self.progress = progress
        self.staleness_max = 0
        self.rss: dict[str, dict[int, Incarnation]] = {p: {} for p in PROCESSES}

    def sample(self) -> None:
        for line in self.progress.poll():  # the line `riptide up` prints for each step
            print(line, file=sys.stderr, flush=True)
        last = self.stack.state("trainer").get("last_step") or {}
        self.staleness_max = max(self.staleness_max, int(last.get("staleness_max") or 0))
        now = time.monotonic()
        for name in PROCESSES:
            pid = self.stack.pid(name)
            if pid is None or (mb := _rss_mb(pid)) is None:
                continue
            inc = self.rss[name].setdefault(pid, Incarnation())
            if inc.ready_at is None and self._ready(name, pid):
                inc.ready_at = now
            if inc.ready_at is None or now - inc.ready_at < self.warmup_s:
                continue
            if inc.baseline_mb is None:
                inc.baseline_mb = mb
            inc.last_mb, inc.samples = mb, inc.samples + 1
            inc.after_baseline.append(mb)

    def _ready(self, name: str, pid: int) -> bool:
        if name == "redis":  # loads nothing: ready once it runs
            return True
        if name == "engine":  # this pid is the fleet's engine and it passed its checks
            engines = self.stack.state("rollout").get("engines") or []
            return any(e.get("pid") == pid and e.get("state") == "ready" for e in engines)
        return self.stack.lifecycle(name) == "ready"

    def rss_report(self) -> dict[str, Any]:
        """Per process: the largest growth over its incarnations (last - baseline after
        ready), that incarnation's baseline and last RSS, and how many were measured."""
        out: dict[str, Any] = {}
        for name, by_pid in self.rss.items():
            measured = [i for i in by_pid.values() if i.growth_mb is not None]
            if not measured:
                out[name] = {"incarnations": len(by_pid), "measured": 0}
                continue
            worst = max(measured, key=lambda i: i.growth_mb or 0.0)
            out[name] = {"growth_mb": round(worst.growth_mb or 0.0, 1),
                         "baseline_mb": round(worst.baseline_mb or 0.0, 1),
                         "last_mb": round(worst.last_mb or 0.0, 1),
                         "samples": worst.samples, "incarnations": len(by_pid),
                         "longest_second_half_growth_mb": round(
                             max(measured, key=lambda i: i.samples).second_half_growth_mb, 1),
                         "measured": len(measured)}
        return out

    def rss_growth_max_mb(self) -> float:
        return max((i.growth_mb or 0.0 for by_pid in self.rss.values()
                    for i in by_pid.values() if i.growth_mb is not None), default=0.0)


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


def event_counts(stack: FaultStack) -> dict[str, Any]:
    """From the run's events, every incarnation's: episodes by verdict, those without a
    verdict by cause, and the reaper's deletes by reason (failed ones apart)."""
    episodes: Counter[str] = Counter()
    causes: Counter[str] = Counter()
    reaped: Counter[str] = Counter()
    for event in iter_events(stack.redis(), stack.run):
        if event.kind == "rollout.episode":
            episodes[str(event.attrs.get("verdict"))] += 1
            if event.attrs.get("verdict") != "scored":
                causes[str(event.attrs.get("no_verdict_cause") or "unspecified")] += 1
        elif event.kind == "sandbox.reap":
            ok = event.attrs.get("ok")
            reaped[str(event.attrs.get("reason")) + ("" if ok else " (failed)")] += 1
    return {"episodes_by_verdict": dict(episodes), "no_verdict_by_cause": dict(causes),
            "sandboxes_reaped": dict(reaped)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval-s", type=float, default=None,
                        help="time between fault starts (default: every kind once in the run)")
    parser.add_argument("--baseline-frac", type=float, default=0.15)
    parser.add_argument("--warmup-s", type=float, default=15.0,
                        help="seconds after a process reported ready before its RSS baseline")
    parser.add_argument("--dir", type=Path, default=None, help="run directory (default: temp)")
    args = parser.parse_args()
    run_dir = args.dir or Path(tempfile.mkdtemp(prefix="riptide-soak-"))
    stack = FaultStack(run_dir)
    rng = random.Random(args.seed)
    total_s = args.minutes * 60
    started = time.monotonic()
    progress = StepProgress(stack.config.redis.url, stack.run)
    stack.start()
    try:
        stack.wait_steps(1, 300)
        sampler = Sampler(stack, args.warmup_s, progress)
        baseline_s = total_s * args.baseline_frac
        step0 = stack.step()
        _wait(stack, sampler, baseline_s)
        baseline_rate = (stack.step() - step0) / (baseline_s / 60)
        kinds = fault_kinds(stack)
        left = total_s - (time.monotonic() - started)
        interval = args.interval_s or max(20.0, left / len(kinds))
        order: list[str] = []
        recoveries: dict[str, list[float]] = {}
        failed_creations = 0
        fault_start_step = stack.step()
        fault_phase_start = time.monotonic()
        slot = 0  # fault k starts at fault_phase_start + k * interval (at once if one overran)
        while time.monotonic() - started < total_s - 5:
            if not order:
                order = list(kinds)
                rng.shuffle(order)
            kind = order.pop()
            before = stack.step()
            outcome = kinds[kind]()
            if kind == "sandbox_failures" and isinstance(outcome, int):
                failed_creations += outcome
            recoveries.setdefault(kind, []).append(round(_recover(stack, sampler, before), 1))
            slot += 1
            next_at = min(fault_phase_start + slot * interval, started + total_s - 5)
            _wait(stack, sampler, max(0.0, next_at - time.monotonic()))
        fault_rate = (stack.step() - fault_start_step) / ((time.monotonic()
                                                           - fault_phase_start) / 60)
        stack.wait_steps(1, RECOVERY_BOUND_S)
        audit = stack.audit()
        events = event_counts(stack)
    finally:
        stack.stop()
        progress.close()
    worst = max((r for rs in recoveries.values() for r in rs), default=0.0)
    result = {
        "minutes": args.minutes, "seed": args.seed, "interval_s": round(interval, 1),
        **{k: v for k, v in audit.as_dict().items() if k != "rollout_dropped"},
        "rollout_dropped_last_incarnation": audit.rollout_dropped,
        **events,
        "faults_injected": {k: len(v) for k, v in recoveries.items()},
        "every_kind_injected": set(recoveries) == set(kinds),
        "recovery_s": recoveries, "recovery_s_max": worst, "recovery_bound_s": RECOVERY_BOUND_S,
        "staleness_max": sampler.staleness_max, "staleness_bound": MAX_STALENESS,
        "steps_per_min_baseline": round(baseline_rate, 2),
        "steps_per_min_under_faults": round(fault_rate, 2),
        "sandbox_creations_failed": failed_creations,
        "rss": sampler.rss_report(), "rss_growth_max_mb": round(sampler.rss_growth_max_mb(), 1),
        "rss_warmup_s": args.warmup_s,
        "ok": audit.lost == [] and audit.duplicated == [] and worst <= RECOVERY_BOUND_S
        and sampler.staleness_max <= MAX_STALENESS,
    }
    if args.dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
