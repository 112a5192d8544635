"""Each advisory speaks on a synthetic run that provokes it and stays silent on a healthy one."""

from __future__ import annotations

from typing import Any

import pytest

from services.rollout.dashboard.advisories import advise
from services.rollout.dashboard.config import AdvisoryConfig
from services.rollout.dashboard.record import RunRecord
from services.testing.synthetic_events import SyntheticRun

PROVOKED: dict[str, dict[str, Any]] = {
    "low_concurrency": {"in_flight_fraction": 0.2},
    "engine_imbalance": {"busy_engine_share": 0.85},
    "low_cache_hit_rate": {"cache_hit_rate": 0.05},
    "stall": {"stall_s": 120.0},
    "no_verdict": {"no_verdict_fraction": 0.3},
    "zero_variance": {"zero_variance_fraction": 0.9},
    "truncated": {"truncated_fraction": 0.5},
    "aborted": {"abort_fraction": 0.1},
    "stale_length_bias": {"stale_drop_fraction": 0.3, "stale_length_factor": 3.0},
    "trainer_idle": {"trainer_idle_fraction": 0.7},
    "no_load_signal": {"no_load_signal_engines": 1},
}


def _record(**knobs: Any) -> RunRecord:
    record = RunRecord()
    for stream, data in SyntheticRun(**knobs).generate():
        (record.add_event if stream == "events" else record.add_episode)(data)
    return record


@pytest.fixture(scope="module")
def healthy() -> list[dict[str, str]]:
    return advise(_record(), AdvisoryConfig())


@pytest.mark.parametrize("code", sorted(PROVOKED))
def test_advisory_speaks_when_provoked(code: str) -> None:
    found = advise(_record(**PROVOKED[code]), AdvisoryConfig())
    matching = [a for a in found if a["code"] == code]
    assert matching, f"{code} silent; got {found}"
    assert matching[0]["threshold"].startswith("rollout.dashboard.advisories.")
    assert len(matching[0]["message"]) > 30


@pytest.mark.parametrize("code", sorted({*PROVOKED, "dp_rank_imbalance"}))
def test_advisory_silent_on_a_healthy_run(code: str, healthy: list[dict[str, str]]) -> None:
    assert [a for a in healthy if a["code"] == code] == []


def test_dp_rank_imbalance_names_the_rank() -> None:
    found = advise(_record(busy_engine_share=0.85), AdvisoryConfig())
    ranks = [a for a in found if a["code"] == "dp_rank_imbalance"]
    assert ranks and "dp rank" in ranks[0]["message"]


def test_thresholds_come_from_config() -> None:
    """The same run speaks or not depending on the configured bound."""
    record = _record(truncated_fraction=0.5)
    assert not [a for a in advise(record, AdvisoryConfig(max_truncated_fraction=0.9))
                if a["code"] == "truncated"]


def test_an_open_phase_far_past_its_median_is_a_stall() -> None:
    """Spans published at their start (end None) are judged while still open."""
    record = _record()
    record.add_event({"kind": "trainer.checkpoint", "service": "trainer",
                      "start": record.now - 200, "end": None, "id": "ckpt-9"})
    found = [a for a in advise(record, AdvisoryConfig()) if a["code"] == "stall"]
    assert found and "trainer.checkpoint ckpt-9 has been open" in found[0]["message"]


def test_a_phase_that_just_took_far_longer_than_its_median_is_a_stall() -> None:
    record = _record()
    last = record.now
    record.add_event({"kind": "trainer.weight_sync", "service": "trainer",
                      "start": last, "end": last + 120, "id": "sync-slow"})
    found = [a for a in advise(record, AdvisoryConfig()) if a["code"] == "stall"]
    assert any("sync-slow took 120 s" in a["message"] for a in found)


def test_no_load_signal_names_the_engine_and_clears_when_the_signal_is_back() -> None:
    record = _record(no_load_signal_engines=1)
    found = [a for a in advise(record, AdvisoryConfig()) if a["code"] == "no_load_signal"]
    assert len(found) == 1 and "http://127.0.0.1:30001" in found[0]["message"]
    assert "http://127.0.0.1:30000" not in found[0]["message"]
    last = record.of_kind("rollout.load")[-1]
    for reading in last.attrs["engines"]:  # the newest reading: every signal back
        reading["load_signal"] = "ok"
    assert not [a for a in advise(record, AdvisoryConfig()) if a["code"] == "no_load_signal"]
