"""Events -> panel data: each panel's figures against what the synthetic run was built with."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import InvalidRequest
from services.common.no_verdict import CAUSE_NAMES
from services.rollout.dashboard import load, samples, timeline, training
from services.rollout.dashboard.record import RunRecord, load_jsonl
from services.rollout.dashboard.summary import thin
from services.testing.synthetic_events import SyntheticRun, write_jsonl


@pytest.fixture(scope="module")
def run() -> SyntheticRun:
    return SyntheticRun(stale_drop_fraction=0.25, seed=3)


@pytest.fixture(scope="module")
def record(run: SyntheticRun, tmp_path_factory: pytest.TempPathFactory) -> RunRecord:
    path = tmp_path_factory.mktemp("events") / "run.jsonl"
    return load_jsonl(write_jsonl(run.generate(), path))


def test_timeline_lanes_and_idle_fraction(record: RunRecord, run: SyntheticRun) -> None:
    phases = timeline.phase_timeline(record)
    lanes = {lane["lane"]: lane["spans"] for lane in phases["lanes"]}
    assert len(lanes) == 1 + run.num_engines  # the trainer and one lane per engine
    kinds = {span["kind"] for span in lanes["trainer"]}
    assert kinds == set(timeline.TRAINER_PHASES)
    assert len(lanes["trainer"]) == 4 * run.num_steps
    assert phases["idle_fraction"] == pytest.approx(run.trainer_idle_fraction, abs=1e-6)
    assert phases["t0"] < phases["t1"] == record.now


def test_an_open_phase_runs_to_now() -> None:
    record = RunRecord()
    for _, data in (e for e in SyntheticRun(stall_s=90.0).generate() if e[0] == "events"):
        record.add_event(data)
    record.add_event({"kind": "trainer.weight_sync", "service": "trainer",
                      "start": record.now - 50, "end": None, "id": "open"})
    spans = timeline.phase_timeline(record)["lanes"][0]["spans"]
    open_spans = [s for s in spans if s["open"]]
    assert len(open_spans) == 1 and open_spans[0]["end"] == record.now


def test_concurrency_per_engine_and_rank(record: RunRecord, run: SyntheticRun) -> None:
    flight = load.concurrency(record)
    assert flight["in_flight"] and {v for _, v in flight["cap"]} == {run.cap}
    assert len(flight["per_engine"]) == run.num_engines
    assert len(flight["per_rank"]) == run.num_engines * run.dp_size
    for _, value in flight["in_flight"]:
        assert value <= run.cap


def test_cache_hit_rates_cumulative_and_windowed(record: RunRecord, run: SyntheticRun) -> None:
    cache = load.cache_hit_rates(record, window_s=30.0)
    assert len(cache["engines"]) == run.num_engines
    for panel in cache["engines"].values():
        assert panel["latest_cumulative"] == pytest.approx(run.cache_hit_rate, abs=0.01)
        assert panel["latest_windowed"] == pytest.approx(run.cache_hit_rate, abs=0.01)


def test_windowed_hit_rate_follows_a_change() -> None:
    """A cache that stops hitting shows in the window long before the cumulative rate."""
    record = RunRecord()
    totals = [0, 0]
    for second in range(200):
        totals[0] += 1000
        totals[1] += 900 if second < 150 else 0
        record.add_event({"kind": "rollout.load", "service": "rollout", "start": second,
                          "end": second, "id": str(second), "weight_version": 0,
                          "attrs": {"in_flight": 1, "cap": 1, "engines": [
                              {"engine": "e", "dp_rank": 0, "running": 1,
                               "prompt_tokens": totals[0], "cached_tokens": totals[1]}]}})
    panel = load.cache_hit_rates(record, window_s=20.0)["engines"]["e"]
    assert panel["latest_windowed"] == 0.0
    assert panel["latest_cumulative"] == pytest.approx(0.9 * 150 / 200)


@pytest.mark.parametrize("warmup", [True, False])
def test_the_first_wait_while_engines_start_is_not_idle_time(
        run: SyntheticRun, tmp_path: Path, warmup: bool) -> None:
    record = load_jsonl(write_jsonl(run.generate(), tmp_path / "run.jsonl"))
    first = min(e.start for e in record.of_kind("trainer.wait_data"))
    record.add_event({"kind": "trainer.wait_data", "service": "trainer", "start": first - 600,
                      "end": first, "attrs": {"groups": 0, "warmup": warmup}})
    idle = timeline.trainer_idle_fraction(record)
    if warmup:
        assert idle == pytest.approx(run.trainer_idle_fraction, abs=1e-6)
    else:  # the same wait, unmarked, would be ten minutes of idling
        assert idle is not None and idle > run.trainer_idle_fraction + 0.3


def test_engines_table_and_live_sandboxes(record: RunRecord, run: SyntheticRun) -> None:
    rows = load.engines_table(record)
    assert len(rows) == run.num_engines * run.dp_size
    assert all(r["healthy"] and r["circuit"] == "closed" for r in rows)
    live = load.live_sandboxes(record)
    # The synthetic run leaves the even-numbered samples of its last step live.
    assert len(live) == run.groups_per_step * (run.samples_per_group // 2)
    assert all(s["age_s"] >= 0 for s in live)


def test_live_sandboxes_come_from_the_newest_snapshot_of_each_reporting_service(
        tmp_path: Path) -> None:
    run = SyntheticRun(live_snapshots=True)
    record = load_jsonl(write_jsonl(run.generate(), tmp_path / "run.jsonl"))
    live = load.live_sandboxes(record)
    assert {s["sandbox"] for s in live} == {
        e.attrs["sandbox"] for e in record.of_kind("sandbox.create")} - {
        e.attrs["sandbox"] for e in record.of_kind("sandbox.delete")}  # not "sbx-gone"
    assert all(s["state"] == "running" and s["provider"] == "local" and s["turns"] == 2
               for s in live)
    assert [s["age_s"] for s in live] == sorted((s["age_s"] for s in live), reverse=True)
    record.add_event({"kind": "rollout.load", "service": "rollout", "start": record.now + 4,
                      "attrs": {}})
    assert [s["age_s"] for s in load.live_sandboxes(record)] == pytest.approx(
        [s["age_s"] + 4 for s in live])  # ages run on with the record's clock
    record.add_event({"kind": "rollout.load", "service": "rollout", "start": record.now + 60,
                      "attrs": {}})
    assert load.live_sandboxes(record) == []  # the service stopped reporting


def test_sandbox_lifecycle_rows_per_service_process(tmp_path: Path) -> None:
    run = SyntheticRun(live_snapshots=True)
    record = load_jsonl(write_jsonl(run.generate(), tmp_path / "run.jsonl"))
    gone, live = load.sandbox_lifecycle(record)
    assert (gone["incarnation"], gone["reporting"], gone["live"]) == ("a1", False, 1)
    num_live = len(load.live_sandboxes(record))
    assert live == {"service": "host:8053", "incarnation": "b2", "live": num_live,
                    "leased": num_live, "reaped": 1, "failed_deletes": 0, "reporting": True}


def test_training_panels(record: RunRecord, run: SyntheticRun) -> None:
    rows = training.steps(record)
    assert [r["step"] for r in rows] == list(range(1, run.num_steps + 1))
    assert all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    dropped = training.dropped_groups(record)
    consumed = sum(training.staleness_histogram(record).values())
    total = run.num_steps * run.groups_per_step * run.samples_per_group
    assert consumed + dropped.get("stale (trainer)", 0) * run.samples_per_group == total
    assert [e["weight_version"] for e in training.evals(record)] == [4, 8]


def test_missing_verdicts_by_cause(tmp_path: Path) -> None:
    run = SyntheticRun(no_verdict_fraction=0.3, seed=5)
    record = load_jsonl(write_jsonl(run.generate(), tmp_path / "run.jsonl"))
    missing = [e for e in record.of_kind("rollout.episode") if e.attrs["verdict"] != "scored"]
    causes = training.no_verdicts_by_cause(record)
    assert missing and sum(causes.values()) == len(missing)
    assert set(causes) <= set(CAUSE_NAMES[1:]) and len(causes) > 1
    assert list(causes.values()) == sorted(causes.values(), reverse=True)


def test_sample_table_and_view(record: RunRecord, run: SyntheticRun) -> None:
    rows = samples.recent_episodes(record, limit=5)
    assert len(rows) == 5 and all(r["has_detail"] for r in rows)
    assert rows[0]["end"] >= rows[-1]["end"] or rows[0]["start"] is not None
    view = samples.sample_view(record.episodes[rows[0]["sample_id"]])
    assert [t["commands"] for t in view["turns"]] == [["ls /app"], ["cat /app/data.csv | wc -l"]]
    assert [t["loss"] for t in view["tokens"]] == [False] * 4 + [True] * 8
    assert view["tokens"][5]["logprob"] <= 0


def test_a_bad_export_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"entry_id": "1-0", "event": {"kind": "x", "service": "trainer", '
                    '"start": 1, "end": 1}}\n'
                    '{"entry_id": "2-0", "event": {"start": 1}}\n')
    with pytest.raises(InvalidRequest, match=r"bad.jsonl:2: not an event"):
        load_jsonl(path)
    with pytest.raises(InvalidRequest, match="cannot read"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_old_events_are_forgotten_past_the_cap() -> None:
    record = RunRecord(max_events=100)
    for _, data in (e for e in SyntheticRun().generate() if e[0] == "events"):
        record.add_event(data)
    assert len(record.events) == 100
    assert sum(len(kind) for kind in record.by_kind.values()) == 100


def test_thin_keeps_the_last_point() -> None:
    series = [[float(i), float(i)] for i in range(1001)]
    thinned = thin(series, 100)
    assert len(thinned) <= 101 and thinned[-1] == series[-1] and thinned[0] == series[0]
