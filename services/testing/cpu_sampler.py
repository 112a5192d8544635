"""Where a run's CPU went: each service's process tree sampled twice from /proc, so a bench can
say which service, and which single thread of it, was busy for how much of the interval (a
thread near 1.0 is an event loop or decode loop that cannot go faster)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.testing.proc_tree import descendants

_TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (the thread's name, its user plus system CPU seconds so far)."""
    threads: dict[tuple[int, int], tuple[str, float]] = {}
    try:
        tids = [t.name for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return threads
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rpartition(")")[2].split()
        threads[(pid, int(tid))] = (name, (int(fields[11]) + int(fields[12])) / _TICK)
    return threads


@dataclass
class CpuSnapshot:
    at: float
    threads: dict[str, dict[tuple[int, int], tuple[str, float]]] = field(default_factory=dict)


def snapshot(services: dict[str, int]) -> CpuSnapshot:
    """Every thread's CPU seconds so far, of each service's process and its descendants."""
    taken = CpuSnapshot(time.monotonic())
    for name, pid in services.items():
        threads: dict[tuple[int, int], tuple[str, float]] = {}
        for member in {pid} | descendants(pid):
            threads.update(_thread_cpu_s(member))
        taken.threads[name] = threads
    return taken


def cpu_use(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, dict[str, object]]:
    """Per service, between two snapshots: its CPU seconds over the wall seconds (cores busy),
    and its busiest thread's share of the interval with the thread's name. Threads that
    appeared in between count from zero; threads gone by `after` are not seen."""
    wall = max(after.at - before.at, 1e-9)
    use: dict[str, dict[str, object]] = {}
    for name, threads in after.threads.items():
        earlier = before.threads.get(name, {})
        spent = {key: (thread, cpu - earlier.get(key, (thread, 0.0))[1])
                 for key, (thread, cpu) in threads.items()}
        busiest = max(spent.values(), key=lambda item: item[1], default=("", 0.0))
        use[name] = {"cores": round(sum(s for _, s in spent.values()) / wall, 3),
                     "busiest_thread": busiest[0],
                     "busiest_thread_share": round(busiest[1] / wall, 3)}
    return use
