"""The phase timeline: trainer phases against rollout activity, and the trainer idle fraction.

Lanes of a Gantt chart share one time axis: the trainer's phases (wait for data, step,
checkpoint, weight sync), one lane per engine with its pauses, and the samples in flight,
so a bubble (the trainer waiting while rollout idles, or engines paused for long syncs)
shows as a gap.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from services.rollout.dashboard.record import RunRecord

TRAINER_PHASES = ("trainer.wait_data", "trainer.step", "trainer.checkpoint",
                  "trainer.weight_sync")


def phase_timeline(record: RunRecord) -> dict[str, Any]:
    """Lanes of spans `{kind, start, end, open, label}`, the in-flight series, the time range."""
    now = record.now
    trainer = [_span(e.kind, e.start, e.end, now, e.attrs.get("step", e.weight_version))
               for e in record.of_kind(*TRAINER_PHASES)]
    pauses: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in record.of_kind("rollout.engine_pause"):
        engine = str(e.attrs.get("engine", "?"))
        pauses[engine].append(_span(e.kind, e.start, e.end, now, e.attrs.get("reason")))
    lanes = [{"lane": "trainer", "spans": trainer}]
    lanes += [{"lane": f"engine {engine}", "spans": spans}
              for engine, spans in sorted(pauses.items())]
    in_flight = [[e.start, e.attrs.get("in_flight", 0)] for e in record.of_kind("rollout.load")]
    starts = [e.start for e in record.events]
    return {"t0": min(starts, default=0.0), "t1": now, "lanes": lanes, "in_flight": in_flight,
            "idle_fraction": trainer_idle_fraction(record)}


def _span(kind: str, start: float, end: float | None, now: float, label: Any) -> dict[str, Any]:
    return {"kind": kind, "start": start, "end": now if end is None else end,
            "open": end is None, "label": None if label is None else str(label)}


def trainer_idle_fraction(record: RunRecord) -> float | None:
    """Time the trainer spent waiting for data over the time its phases cover (None: no
    phases yet). A trainer process's first wait (`warmup`: engines starting, the first
    episodes) counts in neither."""
    spans = record.of_kind(*TRAINER_PHASES)
    if not spans:
        return None
    now = record.now
    begin = min(e.start for e in spans)
    end = max(now if e.end is None else e.end for e in spans)
    waits = [((now if e.end is None else e.end) - e.start, bool(e.attrs.get("warmup")))
             for e in spans if e.kind == "trainer.wait_data"]
    covered = end - begin - sum(d for d, warmup in waits if warmup)
    waited = sum(d for d, warmup in waits if not warmup)
    return waited / covered if covered > 0 else 0.0
