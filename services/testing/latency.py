"""Latency statistics the benches share: percentiles, a paired comparison over interleaved
rounds with its 95% interval, and a process's own CPU time."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

#: two-sided 95% quantiles of Student's t by degrees of freedom (1..10)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used so far, all its threads together."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def paired_difference(mine: list[list[float]], theirs: list[list[float]]) -> dict[str, Any]:
    """Round by round, p50 latency of `mine` minus `theirs` (ms; the same engine and client,
    so the difference is the difference in overhead): the mean, its 95% interval (Student's
    t), `at_most` when the interval reaches 0 or below (not shown higher) and `lower` when it
    lies below 0."""
    diffs = [percentile(m, 0.5) - percentile(t, 0.5) for m, t in zip(mine, theirs, strict=True)]
    mean = statistics.fmean(diffs)
    half = T95[len(diffs) - 1] * statistics.stdev(diffs) / len(diffs) ** 0.5
    return {"mean_ms": round(mean, 4), "ci95_ms": [round(mean - half, 4), round(mean + half, 4)],
            "rounds_lower": sum(d < 0 for d in diffs), "rounds": len(diffs),
            "at_most": mean - half <= 0, "lower": mean + half < 0}
