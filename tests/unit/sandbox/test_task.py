"""The terminal-bench-2 task loader: real tasks load, malformed ones fail precisely."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import NotFound
from services.sandbox.task import Task, TaskFormatError, TaskSet, parse_size_mb

REPO = Path(__file__).resolve().parents[3]
TB2 = REPO.parent / "shared" / "reference" / "tb2"
BUNDLED = REPO / "tasks"

GOOD_TOML = """\
version = "1.0"

[metadata]
difficulty = "easy"
category = "file-operations"
tags = ["bash"]

[verifier]
timeout_sec = 60.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 600.0
docker_image = "ubuntu:24.04"
cpus = 1
memory = "512M"
storage_mb = 2048
allow_internet = false
"""


def make_task(root: Path, toml: str = GOOD_TOML, name: str = "demo") -> Path:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "task.toml").write_text(toml)
    (task / "instruction.md").write_text("Do the thing.\n")
    (task / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    return task


@pytest.mark.skipif(not TB2.is_dir(), reason="reference terminal-bench-2 tasks not present")
def test_every_reference_tb2_task_loads() -> None:
    tasks = TaskSet.load(TB2)
    assert len(tasks) == len([p for p in TB2.iterdir() if (p / "task.toml").is_file()]) >= 6
    for task in tasks:
        env = task.config.environment
        assert task.instruction
        assert env.docker_image == f"alexgshaw/{task.name}:20251031"
        assert (env.cpus, env.memory_mb, env.storage_mb) == (1, 2048, 10240)
        assert task.config.verifier.timeout_sec == 900.0
        assert task.config.agent.timeout_sec == 900.0
        assert task.has_solution and (task.tests_dir / "test.sh").is_file()
    assert tasks.get("fix-git").workdir == "/app/personal-site"
    assert tasks.get("regex-log").workdir == "/app"
    assert tasks.get("largest-eigenval").config.metadata.category == "mathematics"
    copies = tasks.get("largest-eigenval").dockerfile.copies
    assert [(c.sources, c.dest) for c in copies] == [
        (("src/eigen.py",), "/app/eigen.py"),
        (("src/eval.py",), "/app/eval.py"),
    ]


def test_bundled_tasks_load() -> None:
    tasks = TaskSet.load(BUNDLED)
    assert len(tasks) >= 10
    for task in tasks:
        assert task.has_solution
        assert task.config.environment.allow_internet is False


def test_good_task_fields(tmp_path: Path) -> None:
    task = Task.load(make_task(tmp_path))
    assert task.name == "demo" and task.workdir == "/app"
    assert task.config.environment.memory_mb == 512
    assert task.config.environment.storage_mb == 2048
    assert task.config.verifier.timeout_sec == 60.0
    assert task.instruction == "Do the thing."


@pytest.mark.parametrize(
    ("text", "mb"), [("2G", 2048), ("512M", 512), ("1.5G", 1536), ("10Gi", 10240), (300, 300)]
)
def test_parse_size(text: object, mb: int) -> None:
    assert parse_size_mb(text) == mb


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda t: t.replace('memory = "512M"', 'memory = "lots"'),
            r"task\.toml: \[environment\].*'memory': expected a size like '2G'",
        ),
        (
            lambda t: t.replace("cpus = 1", "cpus = 1\ncpu_count = 2"),
            r"task\.toml: \[environment\] cpu_count: unknown key",
        ),
        (
            lambda t: t.replace('memory = "512M"', 'memory = "512M"\nmemory_mb = 512'),
            r"either 'memory' or 'memory_mb', not both",
        ),
        (
            lambda t: t.replace("timeout_sec = 60.0", "timeout_sec = -1"),
            r"\[verifier\] timeout_sec: Input should be greater than 0 \(got -1\)",
        ),
        (
            lambda t: t.replace("allow_internet = false", 'allow_internet = "maybe"'),
            r"\[environment\] allow_internet: Input should be a valid boolean",
        ),
        (lambda t: t.replace("[agent]", "[agent"), r"task\.toml: not valid TOML"),
        (lambda t: t + "\n[extras]\nx = 1\n", r"extras: unknown key"),
    ],
)
def test_malformed_task_toml(tmp_path: Path, edit, expected: str) -> None:  # type: ignore[no-untyped-def]
    path = make_task(tmp_path, edit(GOOD_TOML))
    with pytest.raises(TaskFormatError, match=expected):
        Task.load(path)


def test_missing_parts(tmp_path: Path) -> None:
    path = make_task(tmp_path)
    (path / "tests" / "test.sh").unlink()
    with pytest.raises(TaskFormatError, match=r"tests/test\.sh: missing"):
        Task.load(path)
    path = make_task(tmp_path, name="b")
    (path / "instruction.md").write_text("  \n")
    with pytest.raises(TaskFormatError, match=r"instruction\.md: empty"):
        Task.load(path)
    path = make_task(tmp_path, GOOD_TOML.replace('docker_image = "ubuntu:24.04"\n', ""), "c")
    (path / "environment" / "Dockerfile").unlink()
    with pytest.raises(TaskFormatError, match=r"Dockerfile: missing, and task\.toml"):
        Task.load(path)
    path = make_task(tmp_path, name="d")
    (path / "task.toml").unlink()
    with pytest.raises(TaskFormatError, match=r"d/task\.toml: missing"):
        Task.load(path)


def test_bad_dockerfile_names_line(tmp_path: Path) -> None:
    path = make_task(tmp_path)
    (path / "environment" / "Dockerfile").write_text("FROM x\n\nCOPY onlyone\n")
    with pytest.raises(TaskFormatError, match=r"Dockerfile: line 3: COPY needs a source"):
        Task.load(path)


def test_task_set(tmp_path: Path) -> None:
    make_task(tmp_path, name="a")
    make_task(tmp_path, name="b")
    (tmp_path / "not-a-task").mkdir()
    tasks = TaskSet.load(tmp_path)
    assert tasks.names == ["a", "b"] and "a" in tasks and len(tasks) == 2
    with pytest.raises(NotFound, match="unknown task 'zzz'"):
        tasks.get("zzz")
    with pytest.raises(TaskFormatError, match="no task directories"):
        TaskSet.load(tmp_path / "not-a-task")
    make_task(tmp_path, GOOD_TOML + '\n[task]\nname = "a"\n', name="c")
    with pytest.raises(TaskFormatError, match="task name 'a' already used"):
        TaskSet.load(tmp_path)
