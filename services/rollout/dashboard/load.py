"""Rollout load panels: samples in flight against the cap, running requests per engine and
per dp rank, prefix-cache hit rates, the engines table and the live sandboxes.

All of it comes from the `rollout.load` readings (about one a second; the engines' cached and
prompt token counts are cumulative) and the sandbox services' `sandbox.live` snapshots (the
create/delete spans for a run recorded without them).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from services.rollout.dashboard.record import Event, RunRecord


def concurrency(record: RunRecord) -> dict[str, Any]:
    """Series `[t, value]`: in flight, the cap, running per engine and per (engine, dp rank)."""
    in_flight, cap = [], []
    engine: dict[str, list[list[float]]] = defaultdict(list)
    rank: dict[str, list[list[float]]] = defaultdict(list)
    for e in record.of_kind("rollout.load"):
        in_flight.append([e.start, e.attrs.get("in_flight", 0)])
        cap.append([e.start, e.attrs.get("cap", 0)])
        per_engine: dict[str, float] = defaultdict(float)
        for reading in e.attrs.get("engines", []):
            name = str(reading.get("engine"))
            per_engine[name] += reading.get("running", 0)
            rank[f"{name} dp{reading.get('dp_rank', 0)}"].append([e.start,
                                                                  reading.get("running", 0)])
        for name, running in per_engine.items():
            engine[name].append([e.start, running])
    return {"in_flight": in_flight, "cap": cap, "per_engine": dict(engine),
            "per_rank": dict(rank)}


def engine_totals(event: Event) -> dict[str, tuple[float, float]]:
    """(cached, prompt) tokens so far per engine, summed over its dp ranks, of one reading."""
    totals: dict[str, tuple[float, float]] = {}
    for reading in event.attrs.get("engines", []):
        name = str(reading.get("engine"))
        cached, prompt = totals.get(name, (0.0, 0.0))
        totals[name] = (cached + reading.get("cached_tokens", 0),
                        prompt + reading.get("prompt_tokens", 0))
    return totals


def cache_hit_rates(record: RunRecord, window_s: float) -> dict[str, Any]:
    """Per engine, series `[t, rate]` of the cumulative hit rate and of the rate over the
    last `window_s` seconds, plus the latest of each."""
    loads = record.of_kind("rollout.load")
    history = [(e.start, engine_totals(e)) for e in loads]
    engines: dict[str, dict[str, Any]] = {}
    begin = 0
    for t, totals in history:
        while history[begin][0] < t - window_s:
            begin += 1
        before = history[begin][1]
        for name, (cached, prompt) in totals.items():
            panel = engines.setdefault(name, {"cumulative": [], "windowed": []})
            if prompt:
                panel["cumulative"].append([t, cached / prompt])
            old_cached, old_prompt = before.get(name, (0.0, 0.0))
            if prompt > old_prompt:
                panel["windowed"].append([t, (cached - old_cached) / (prompt - old_prompt)])
    for panel in engines.values():
        panel["latest_cumulative"] = panel["cumulative"][-1][1] if panel["cumulative"] else None
        panel["latest_windowed"] = panel["windowed"][-1][1] if panel["windowed"] else None
    return {"window_s": window_s, "engines": engines}


def engines_table(record: RunRecord) -> list[dict[str, Any]]:
    """One row per (engine, dp rank) from the newest load reading."""
    loads = record.of_kind("rollout.load")
    if not loads:
        return []
    rows = [dict(reading) for reading in loads[-1].attrs.get("engines", [])]
    totals = engine_totals(loads[-1])
    for row in rows:
        cached, prompt = totals.get(str(row.get("engine")), (0.0, 0.0))
        row["hit_rate"] = cached / prompt if prompt else None
    return sorted(rows, key=lambda r: (str(r.get("engine")), r.get("dp_rank", 0)))


def live_sandboxes(record: RunRecord) -> list[dict[str, Any]]:
    """The live sandboxes, oldest first, with their age in seconds at the record's clock:
    the newest `sandbox.live` snapshot of each sandbox service that is still reporting; for
    a run without snapshots, the sandboxes created and not yet deleted."""
    snapshots = record.of_kind("sandbox.live")
    if not snapshots:
        return _created_not_deleted(record)
    newest: dict[str, Event] = {}
    for e in snapshots:
        newest[str(e.attrs.get("instance") or e.id)] = e
    now, rows = record.now, []
    for e in newest.values():
        heartbeat_s = float(e.attrs.get("heartbeat_s") or 10.0)
        if now - e.start > 3 * heartbeat_s:  # the service stopped reporting (gone)
            continue
        for row in e.attrs.get("sandboxes") or []:
            if isinstance(row, dict):
                rows.append({**row, "age_s": float(row.get("age_s") or 0.0) + now - e.start})
    return sorted(rows, key=lambda row: -row["age_s"])


def sandbox_lifecycle(record: RunRecord) -> list[dict[str, Any]]:
    """One row per sandbox-service process of the run, from its newest `sandbox.live`
    snapshot: live, leased, reaped and failed deletes, and whether it still reports."""
    newest: dict[str, Event] = {}
    for e in record.of_kind("sandbox.live"):
        newest[str(e.attrs.get("incarnation") or e.attrs.get("instance") or e.id)] = e
    rows = []
    for e in sorted(newest.values(), key=lambda e: e.start):
        heartbeat_s = float(e.attrs.get("heartbeat_s") or 10.0)
        rows.append({"service": e.attrs.get("service_instance") or e.attrs.get("instance"),
                     "incarnation": e.attrs.get("incarnation", ""),
                     "live": e.attrs.get("num_alive", e.attrs.get("num_live", 0)),
                     "leased": e.attrs.get("num_leased"), "reaped": e.attrs.get("num_reaped"),
                     "failed_deletes": e.attrs.get("num_delete_failures"),
                     "reporting": record.now - e.start <= 3 * heartbeat_s})
    return rows


def _created_not_deleted(record: RunRecord) -> list[dict[str, Any]]:
    deleted = {_sandbox(e) for e in record.of_kind("sandbox.delete")}
    created = {_sandbox(e): e for e in record.of_kind("sandbox.create")
               if e.attrs.get("sandbox") and _sandbox(e) not in deleted}  # no id: create failed
    now = record.now
    return [{"sandbox": _sandbox(e), "sample_id": e.id, "task_id": e.attrs.get("task_id"),
             "age_s": now - e.start}
            for e in sorted(created.values(), key=lambda e: e.start)]


def _sandbox(event: Event) -> str:
    return str(event.attrs.get("sandbox") or event.id)
