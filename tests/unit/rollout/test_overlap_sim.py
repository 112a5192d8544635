"""bench/overlap.py's simulation at small scale: async keeps the trainer busy, sync does not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from services.testing.virtual_clock import run_virtual

_spec = importlib.util.spec_from_file_location(
    "overlap_bench", Path(__file__).resolve().parents[3] / "bench" / "overlap.py")
assert _spec is not None and _spec.loader is not None
overlap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overlap)


def test_async_sample_overlaps_and_sync_idles() -> None:
    train_s = 75.0
    fast = run_virtual(overlap._run_mode("sample", 8, 12, train_s, 3.0, 0))
    sync = run_virtual(overlap._run_mode("group", 0, 6, train_s, 3.0, 0))
    assert fast["trainer_idle_fraction"] < 0.1 < 0.5 < sync["trainer_idle_fraction"]
    assert fast["samples_per_s"] > 2 * sync["samples_per_s"]
    assert fast["staleness_max"] <= 8 and sync["staleness_max"] == 0
    assert fast["mean_in_flight"] > 120
