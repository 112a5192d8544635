"""The architecture check (`lint-imports`, contracts in pyproject.toml) holds on the tree and
fails on a copy of it with one forbidden import added."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# (module that gains the import, the import, the contract it breaks)
VIOLATIONS = [
    ("services/common/buffer.py", "import services.trainer.objective.loss",
     "services.common imports no service"),
    ("services/trainer/objective/loss.py", "import services.engine.sampling",
     "no service imports another"),
    ("services/sandbox/agent.py", "import services.rollout.staleness",
     "no service imports another"),
    ("services/router/policies/base.py", "import services.testing.sim_engine",
     "services import neither the composition root nor the test servers"),
    ("services/rollout/fleet.py", "import services.deployment",
     "services import neither the composition root nor the test servers"),
    ("services/trainer/parallel/parallel.py", "import services.trainer.model.model",
     "the trainer's rooms are layered"),
    ("services/trainer/optim/grad_norm.py", "import services.trainer.objective.loss",
     "the trainer's rooms are layered"),
    ("services/_proto/riptide/v1/__init__.py", "import services.common.errors",
     "generated stubs import nothing of ours"),
]


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the copy shadows the installed package
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def _copy_tree(dest: Path) -> Path:
    shutil.copytree(ROOT / "services", dest / "services",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    result = _lint_imports(_copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "statement", "contract"), VIOLATIONS,
                         ids=[v[0].split("/", 1)[1] for v in VIOLATIONS])
def test_a_forbidden_import_breaks_its_contract(tmp_path: Path, module: str, statement: str,
                                                contract: str) -> None:
    tree = _copy_tree(tmp_path)
    with open(tree / module, "a") as source:
        source.write(f"\n{statement}  # added by the test\n")
    result = _lint_imports(tree)
    assert result.returncode != 0, result.stdout
    assert f"{contract} BROKEN" in result.stdout, result.stdout
