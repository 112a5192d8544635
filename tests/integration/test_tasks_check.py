"""A task author's tools, end to end: `riptide tasks check` and `riptide eval --scripted` run
each task's oracle and no-op in real local sandboxes and exit 1 on a task that scores wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELDOUT = REPO / "tasks" / "starter" / "heldout"


def _riptide(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def _folder(root: Path) -> Path:
    """Two good tasks, one whose oracle fails, one that passes without any work."""
    for name in ("last-line", "sort-numbers"):
        shutil.copytree(HELDOUT / name, root / name)
    broken = Path(shutil.copytree(HELDOUT / "last-line", root / "broken-oracle"))
    (broken / "solution" / "solve.sh").write_text(
        "#!/bin/bash\necho 'make build' > /app/last.txt\n")
    lax = Path(shutil.copytree(HELDOUT / "last-line", root / "lax-verifier"))
    (lax / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n")
    return root


def _table(stdout: str) -> dict[str, str]:
    rows = [line.removeprefix("[check] ") for line in stdout.splitlines()
            if line.startswith("[check] ") and "layout:" not in line]
    return {row.split()[0]: row for row in rows[1:]}


def test_tasks_check_names_the_tasks_that_score_wrong(tmp_path: Path) -> None:
    result = _riptide("tasks", "check", str(_folder(tmp_path)))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[check] layout: 4 tasks" in result.stdout
    table = _table(result.stdout)
    assert table["last-line"].split()[1:] == ["1", "0", "ok"]
    assert table["sort-numbers"].split()[1:] == ["1", "0", "ok"]
    assert table["broken-oracle"].split()[1:3] == ["0", "0"]
    assert table["broken-oracle"].endswith("oracle should score 1")
    assert table["lax-verifier"].split()[1:3] == ["1", "1"]
    assert table["lax-verifier"].endswith("noop should score 0")
    report = json.loads(result.stdout.strip().splitlines()[-1])["tasks_check"]
    assert report["ok"] is False and report["oracle"]["broken-oracle"]["reward"] == 0.0


def test_tasks_check_passes_a_good_folder(tmp_path: Path) -> None:
    for name in ("last-line", "count-items"):
        shutil.copytree(HELDOUT / name, tmp_path / name)
    result = _riptide("tasks", "check", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(_table(result.stdout)) == {"last-line", "count-items"}


def test_layout_problems_stop_the_check_before_any_sandbox(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "sort-numbers" / "instruction.md").unlink()
    result = _riptide("tasks", "check", str(folder))
    assert result.returncode == 1
    assert result.stdout.splitlines()[0] == (
        f"[check] {folder / 'sort-numbers' / 'instruction.md'}: missing (the task's instruction)")
    assert "oracle" not in result.stdout  # no scripted episode ran


def test_eval_scripted_checks_one_policy(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    oracle = _riptide("eval", "--tasks", str(folder), "--scripted", "oracle")
    assert oracle.returncode == 1, oracle.stdout + oracle.stderr
    table = _table(oracle.stdout)
    assert table["broken-oracle"].endswith("oracle should score 1")
    assert table["lax-verifier"].split()[1:] == ["1", "ok"]
    noop = _riptide("eval", "--tasks", str(folder), "--scripted", "noop")
    assert noop.returncode == 1
    table = _table(noop.stdout)
    assert table["lax-verifier"].endswith("noop should score 0")
    assert table["broken-oracle"].split()[1:] == ["0", "ok"]
    shutil.rmtree(folder / "lax-verifier")
    assert _riptide("eval", "--tasks", str(folder), "--scripted", "noop").returncode == 0
