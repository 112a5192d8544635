"""Training panels: per-step figures, staleness of consumed samples, dropped groups, evals."""

from __future__ import annotations

from collections import Counter
from typing import Any

from services.rollout.dashboard.record import RunRecord

STEP_FIGURES = ("reward_mean", "success_rate", "tokens_per_s", "loss", "mismatch_kl",
                "groups", "samples", "tokens", "idle_fraction")


def steps(record: RunRecord) -> list[dict[str, Any]]:
    """One row per finished trainer step: its number, weight version, time and figures."""
    rows = []
    for e in record.of_kind("trainer.step"):
        if e.end is None:
            continue
        row = {"step": e.attrs.get("step"), "weight_version": e.weight_version,
               "end": e.end, "step_time_s": e.end - e.start}
        row.update({k: e.attrs.get(k) for k in STEP_FIGURES})
        rows.append(row)
    return rows


def staleness_histogram(record: RunRecord) -> dict[str, int]:
    """Consumed samples by staleness (weight versions behind the trainer), over all steps."""
    counts: Counter[int] = Counter()
    for e in record.of_kind("trainer.step"):
        for value in e.attrs.get("staleness") or []:
            if isinstance(value, int | float):
                counts[int(value)] += 1
    return {str(k): counts[k] for k in sorted(counts)}


DROP_KINDS = ("rollout.group_dropped", "trainer.group_dropped")


def dropped_groups(record: RunRecord) -> dict[str, int]:
    """Dropped groups by reason and by who dropped them (the rollout before the stream, the
    trainer after reading)."""
    counts = Counter(f"{e.attrs.get('reason', '?')} ({e.service})"
                     for e in record.of_kind(*DROP_KINDS))
    return dict(counts.most_common())


def no_verdicts_by_cause(record: RunRecord) -> dict[str, int]:
    """Episodes without verdict by cause (services/common/no_verdict.py), most first."""
    counts = Counter(str(e.attrs.get("no_verdict_cause") or "unspecified")
                     for e in record.of_kind("rollout.episode")
                     if e.attrs.get("verdict") not in ("scored", None))
    return dict(counts.most_common())


def evals(record: RunRecord) -> list[dict[str, Any]]:
    """Held-out evaluation results by weight version."""
    return [{"weight_version": e.attrs.get("weight_version", e.weight_version),
             "mean_success": e.attrs.get("mean_success"),
             "per_task": e.attrs.get("per_task") or {}}
            for e in record.of_kind("rollout.eval")]
