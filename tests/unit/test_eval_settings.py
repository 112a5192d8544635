"""`riptide eval`'s settings: a run's config supplies every one, flags override, else defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import _parser
from services.common.config import dump_config
from services.common.errors import ConfigError
from services.eval_settings import resolve
from services.local_stack import local_config

REPO = Path(__file__).resolve().parents[2]
HELDOUT = REPO / "tasks" / "starter" / "heldout"


def _run(tmp_path: Path) -> Path:
    """A run directory as `riptide up` or the learning run leaves it, with two checkpoints."""
    run = tmp_path / "run"
    config = local_config(run, {
        "rollout": {"eval": {"task_ids": ["last-line", "sort-numbers"], "greedy": True,
                             "num_samples": 2},
                    "scheduler": {"max_new_tokens": 40},
                    "fleet": {"builtin_args": ["--num-threads", "2", "--dtype", "bfloat16"]}},
        "sandbox": {"tasks_dir": str(HELDOUT),
                    "agent": {"max_turns": 3, "protocol": "markdown_bash",
                              "max_context_tokens": 1024}}})
    run.mkdir()
    (run / "config.toml").write_text(dump_config(config))
    for step in (2, 3):
        (run / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    (run / "checkpoints" / ".tmp-step-00000004").mkdir()  # half-written: not a checkpoint
    return run


def _settings(*argv: str):  # type: ignore[no-untyped-def]
    return resolve(_parser().parse_args(["eval", *argv]))


def test_a_run_supplies_every_setting(tmp_path: Path) -> None:
    run = _run(tmp_path)
    s = _settings("--run", str(run))
    assert s.tasks.names == ["last-line", "sort-numbers"]  # the run's held-out tasks
    assert (s.agent.max_turns, s.agent.max_new_tokens, s.agent.max_context_tokens,
            s.agent.protocol) == (3, 40, 1024, "markdown_bash")
    assert (s.greedy, s.num_samples) == (True, 2)
    assert s.engine_args == ["--num-threads", "2", "--dtype", "bfloat16"]
    assert s.checkpoint == run / "checkpoints" / "step-00000003"
    assert s.base == run / "model"
    assert s.run == {"dir": str(run), "checkpoint_step": 3}


def test_flags_override_the_run(tmp_path: Path) -> None:
    run = _run(tmp_path)
    s = _settings("--run", str(run), "--tasks", str(HELDOUT), "--max-turns", "1",
                  "--no-greedy", "--temperature", "0.5", "--engine-dtype", "float32",
                  "--engine-threads", "1",
                  "--checkpoint", str(run / "checkpoints" / "step-00000002"))
    assert len(s.tasks) == 10 and s.agent.max_turns == 1 and s.agent.max_new_tokens == 40
    assert (s.greedy, s.temperature) == (False, 0.5)
    assert s.engine_args == ["--dtype", "float32", "--num-threads", "1"]
    assert s.checkpoint == run / "checkpoints" / "step-00000002"


def test_the_engine_device_is_the_runs_unless_a_flag_names_one(tmp_path: Path) -> None:
    run = tmp_path / "gpu-run"
    config = local_config(run, {"rollout": {"fleet": {"builtin_args": [
        "--device", "cuda", "--dtype", "bfloat16"]}}, "sandbox": {"tasks_dir": str(HELDOUT)}})
    run.mkdir()
    (run / "config.toml").write_text(dump_config(config))
    assert _settings("--run", str(run)).engine_args == ["--device", "cuda", "--dtype",
                                                        "bfloat16"]
    assert _settings("--run", str(run), "--engine-device", "cpu").engine_args == [
        "--dtype", "bfloat16", "--device", "cpu"]
    assert _settings("--tasks", str(HELDOUT), "--engine-device", "cuda:1").engine_args == [
        "--dtype", "auto", "--device", "cuda:1"]


def test_without_a_run_the_defaults_apply(tmp_path: Path) -> None:
    s = _settings("--tasks", str(HELDOUT))
    assert (s.agent.max_turns, s.agent.max_new_tokens, s.agent.protocol) == (4, 96, "markdown_bash")
    assert (s.greedy, s.temperature, s.num_samples) == (False, 0.8, 1)
    assert s.engine_args == ["--dtype", "auto"] and s.checkpoint is None and s.run == {}


def test_a_run_without_checkpoints_scores_its_model(tmp_path: Path) -> None:
    run = _run(tmp_path)
    for step in (2, 3):
        (run / "checkpoints" / f"step-{step:08d}").rmdir()
    assert _settings("--run", str(run)).checkpoint == run / "model"


def test_bad_runs_and_missing_tasks_fail_precisely(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs --tasks FOLDER, or --run DIR"):
        _settings()
    with pytest.raises(ConfigError, match=r"config.toml: no such file \(--run names a run dir"):
        _settings("--run", str(tmp_path))
