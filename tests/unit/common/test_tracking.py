"""The metrics export: scalars from a run's events, written to TensorBoard and to an offline
W&B run, read back with each tool's own reader."""

from __future__ import annotations

import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from services.cli import main
from services.common.config import RunConfig
from services.common.errors import ConfigError
from services.common.events import Event, load_events
from services.common.tracking.exporter import MetricsExporter
from services.common.tracking.scalars import ScalarBuilder
from services.common.tracking.sinks import TensorBoardSink, WandbSink
from services.testing.synthetic_events import SyntheticRun, write_jsonl

NUM_STEPS = 8


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = SyntheticRun(num_steps=NUM_STEPS, stale_drop_fraction=0.3)
    return write_jsonl(run.generate(), tmp_path_factory.mktemp("run") / "events.jsonl")


def _steps(path: Path) -> list[Event]:
    return [e for e in load_events(path) if e.kind == "trainer.step"]


def test_scalars_follow_the_steps_and_weight_versions(saved_run: Path) -> None:
    builder = ScalarBuilder()
    scalars = [s for e in load_events(saved_run) for s in builder.add(e)]
    by_tag: dict[str, dict[int, float]] = {}
    for s in scalars:
        by_tag.setdefault(s.tag, {})[s.step] = s.value
    steps = _steps(saved_run)
    assert by_tag["train/reward_mean"] == pytest.approx(
        {e.attrs["step"]: e.attrs["reward_mean"] for e in steps})
    assert sorted(by_tag["train/loss"]) == list(range(1, NUM_STEPS + 1))
    assert {s.axis for s in scalars if s.tag.startswith("eval/")} == {"weight_version"}
    assert sorted(by_tag["eval/mean_success"]) == [4, 8]  # evals of weight versions 4 and 8
    assert by_tag["eval/task/csv-revenue"][8] == 0.5
    # cumulative cached / prompt tokens of the synthetic engines: 0.75 of every prompt
    assert by_tag["rollout/cache_hit_rate"][NUM_STEPS] == pytest.approx(0.75, abs=0.01)
    assert all(v == 16 for v in by_tag["rollout/episodes"].values())  # 4 groups x 4 samples
    dropped = sum(e.kind == "trainer.group_dropped" for e in load_events(saved_run))
    assert dropped and sum(by_tag["dropped/trainer/stale"].values()) == dropped


def test_tensorboard_export_reads_back_with_tensorboard(saved_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tracking extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    assert main(["events", "export", "--format", "tensorboard", "--events", str(saved_run),
                 "--out", str(logdir)]) == 0
    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert {"train/reward_mean", "train/tokens_per_s", "train/idle_fraction",
            "train/staleness_mean", "rollout/cache_hit_rate", "eval/mean_success"} <= set(tags)
    steps = _steps(saved_run)
    reward = accumulator.Scalars("train/reward_mean")
    assert [p.step for p in reward] == [e.attrs["step"] for e in steps]
    assert [p.value for p in reward] == pytest.approx([e.attrs["reward_mean"] for e in steps])
    assert [p.wall_time for p in reward] == pytest.approx([e.end for e in steps])
    assert [p.step for p in accumulator.Scalars("eval/mean_success")] == [4, 8]


def _wandb_records(path: Path) -> list[Any]:
    """The records of a `.wandb` file: a 7-byte header, then LevelDB-log framed protobuf
    `Record`s (32 KiB blocks; each chunk: crc32c, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow  # starts wandb-core, its own process: 2 s on an idle machine, more when busy
def test_wandb_offline_run_holds_the_logged_history(saved_run: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="the tracking extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink("riptide-test", "offline", tmp_path / "wb", "synthetic")
    exporter = MetricsExporter([sink])
    assert exporter.add_all(load_events(saved_run)) > 0
    exporter.close()
    files = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    # wandb-core, its own process, may still be writing when finish() returns: its last
    # record is the run's `exit`.
    deadline = time.monotonic() + 10.0
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(files[0])):
        assert time.monotonic() < deadline, "the offline run has no exit record after 10 s"
        time.sleep(0.05)
    history = []
    for record in _wandb_records(files[0]):
        if record.WhichOneof("record_type") == "history":
            items = ((item.key or "/".join(item.nested_key), item.value_json)
                     for item in record.history.item)  # wandb-core writes keys as nested_key
            history.append({key: float(value) for key, value in items
                            if not key.startswith("_")})
    train = [row for row in history if "trainer_step" in row]
    steps = _steps(saved_run)
    assert [row["trainer_step"] for row in train] == [e.attrs["step"] for e in steps]
    assert [row["train/reward_mean"] for row in train] == pytest.approx(
        [e.attrs["reward_mean"] for e in steps])
    assert {"train/loss", "rollout/cache_hit_rate"} <= set(train[-1])
    evals = [row for row in history if "weight_version" in row]
    assert [(row["weight_version"], "eval/mean_success" in row) for row in evals] == [
        (4, True), (8, True)]


def test_export_errors_are_precise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    export = ["events", "export", "--format", "tensorboard", "--out", str(tmp_path / "tb")]
    assert main([*export, "--events", str(tmp_path / "absent.jsonl")]) == 2
    assert "cannot read the events export" in capsys.readouterr().err
    assert main([*export, "--redis", "redis://127.0.0.1:1/0"]) == 2
    assert "--redis needs --run" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"entry_id": "1-0", "event": {"kind": "trainer.step"}}\n')
    assert main([*export, "--events", str(bad)]) == 2
    assert f"{bad}:1: not an event" in capsys.readouterr().err


def test_a_missing_extra_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with pytest.raises(ConfigError, match=r"tracking` extra.*riptide\[tracking\]"):
        TensorBoardSink(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="Weights & Biases export needs the `tracking` extra"):
        WandbSink("p", "offline", tmp_path, "run")


def test_tracking_needs_the_events_stream() -> None:
    with pytest.raises(ValueError, match="run.tracking exports the metrics of the events"):
        RunConfig(admin_token="x" * 8, events={"enabled": False},
                  tracking={"tensorboard_dir": "tb"})
    assert not RunConfig(admin_token="x" * 8).tracking.enabled
    with pytest.raises(ValueError, match="wandb_mode"):
        RunConfig(admin_token="x" * 8, tracking={"wandb_project": "p", "wandb_mode": "cloud"})
