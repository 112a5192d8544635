"""A task folder's layout checks: every problem named precisely, all of them at once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.sandbox.evaluate import eval_sample_id, task_of_sample_id
from services.sandbox.task import TaskFormatError
from services.sandbox.task_check import layout_problems

REPO = Path(__file__).resolve().parents[3]
HELDOUT = REPO / "tasks" / "starter" / "heldout"


def _copy(root: Path, name: str, source: str = "last-line") -> Path:
    return Path(shutil.copytree(HELDOUT / source, root / name))


def test_the_starter_tasks_have_no_layout_problem() -> None:
    for split in ("train", "heldout"):
        tasks, problems = layout_problems(REPO / "tasks" / "starter" / split)
        assert problems == [] and len(tasks) >= 10


def test_every_problem_of_a_folder_is_named(tmp_path: Path) -> None:
    good = _copy(tmp_path, "good")
    (_copy(tmp_path, "no-toml") / "task.toml").unlink()
    bad_key = _copy(tmp_path, "bad-key")
    toml = bad_key / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 30.0", "timeout_secs = 30.0"))
    (_copy(tmp_path, "no-solution") / "solution" / "solve.sh").unlink()
    silent = _copy(tmp_path, "silent-verifier")
    (silent / "tests" / "test.sh").write_text("#!/bin/bash\nexit 0\n")
    (_copy(tmp_path, "no-instruction") / "instruction.md").unlink()
    nested = tmp_path / "more"
    _copy(nested, "inner")
    tasks, problems = layout_problems(tmp_path)
    assert [t.name for t in tasks] == ["good"] and good.is_dir()
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert f"{tmp_path / 'no-toml' / 'task.toml'}: missing (a task directory holds" in text
    assert f"{bad_key / 'task.toml'}: [verifier] timeout_secs: unknown key" in text
    assert f"{tmp_path / 'no-solution' / 'solution' / 'solve.sh'}: missing (the oracle" in text
    assert f"{silent / 'tests' / 'test.sh'}: no file under tests/ mentions /logs/verifier" in text
    assert f"{tmp_path / 'no-instruction' / 'instruction.md'}: missing" in text
    assert f"{nested}: holds task folders but is no task itself" in text


def test_a_name_used_twice_and_an_empty_folder(tmp_path: Path) -> None:
    one, two = _copy(tmp_path, "one"), _copy(tmp_path, "two")
    for folder in (one, two):
        toml = folder / "task.toml"
        toml.write_text('[task]\nname = "same"\n' + toml.read_text())
    _, problems = layout_problems(tmp_path)
    assert problems == [f"{two}: task name 'same' already used by {one}"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert layout_problems(empty)[1] == [f"{empty}: no task directories (each task is a "
                                         "subdirectory holding task.toml, instruction.md, "
                                         "environment/Dockerfile (or [environment] "
                                         "docker_image), tests/test.sh, solution/solve.sh)"]
    with pytest.raises(TaskFormatError, match="not a directory of tasks"):
        layout_problems(tmp_path / "absent")


@pytest.mark.parametrize("name", ["last-line", "a-b-c", "x"])
def test_the_task_of_an_eval_sample_id(name: str) -> None:
    assert task_of_sample_id(eval_sample_id(name, 12)) == name
