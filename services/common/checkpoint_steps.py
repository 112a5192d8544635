"""The steps a trainer checkpoint directory holds, read from its `step-<n>` folder names.

The trainer writes each checkpoint beside its final name and renames it when complete
(services/trainer/weights/checkpoint.py), so a `step-<n>` folder is a whole checkpoint. Read by
`riptide up` (fresh run or resume), its summary and the benches, which report these steps
next to the steps they counted so the two can be compared.
"""

from __future__ import annotations

from pathlib import Path


def checkpoint_steps(checkpoint_dir: Path | str) -> list[int]:
    """The steps of the complete checkpoints under `checkpoint_dir`, ascending."""
    steps = [int(p.name.split("-", 1)[1]) for p in Path(checkpoint_dir).glob("step-*")
             if p.is_dir() and p.name.split("-", 1)[1].isdigit()]
    return sorted(steps)


def latest_checkpoint_step(checkpoint_dir: Path | str) -> int:
    """The step of the newest complete checkpoint under `checkpoint_dir` (0: none)."""
    return max(checkpoint_steps(checkpoint_dir), default=0)
