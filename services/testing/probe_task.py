"""A one-off task in terminal-bench-2 layout, with the resources a sandbox test needs."""

from __future__ import annotations

from pathlib import Path

from services.sandbox.task import Task

_TASK_TOML = """\
version = "1.0"
[verifier]
timeout_sec = 30.0
[agent]
timeout_sec = 60.0
[environment]
cpus = 1
memory = "{memory}"
storage = "{storage}"
allow_internet = false
"""


def probe_task(root: Path, memory: str, storage: str,
               app_files: dict[str, str] | None = None) -> Task:
    """Write a task at `root` whose image is ubuntu with `app_files` copied into /app."""
    (root / "environment" / "app").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "task.toml").write_text(_TASK_TOML.format(memory=memory, storage=storage))
    (root / "instruction.md").write_text("Probe the sandbox.\n")
    dockerfile = "FROM ubuntu:24.04\nWORKDIR /app\n"
    if app_files:
        dockerfile += "COPY app/ /app/\n"
        for name, text in app_files.items():
            (root / "environment" / "app" / name).write_text(text)
    (root / "environment" / "Dockerfile").write_text(dockerfile)
    (root / "tests" / "test.sh").write_text("echo 0 > /logs/verifier/reward.txt\n")
    return Task.load(root)
