"""Atomic trainer checkpoints: model, optimizer (disk-streamed state included), RNG, progress.

A checkpoint is the directory `<dir>/step-<n>`. It is written as `<dir>/.tmp-step-<n>`, every
file and the directory are fsynced, then it is renamed into place and the parent fsynced:
a `step-*` directory exists only when complete, and the newest one is the one to resume.
`TrainerState` carries what exact resumption needs besides the weights: the step, the
weight version, the group ids trained (and dropped, with a reason) so far and the stream
entries consumed since the previous checkpoint (acked only after this one is durable).
Called by loop.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from services.trainer.model.policy import Policy

STATE_FILE = "trainer_state.json"
RNG_FILE = "rng.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerState:
    """Progress of training, saved with every checkpoint."""

    step: int = 0
    weight_version: int = 0
    trained_group_ids: list[str] = field(default_factory=list)
    unacked_entry_ids: list[str] = field(default_factory=list)
    #: Group ids read but not trained, with the reason (e.g. "stale"): never lost silently.
    dropped_groups: dict[str, str] = field(default_factory=dict)
    num_samples: int = 0
    num_tokens: int = 0


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


class Checkpointer:
    """Writes, finds and restores checkpoints under one directory."""

    def __init__(self, directory: str | Path, num_kept: int = 2) -> None:
        self.directory = Path(directory)
        self.num_kept = num_kept
        self.directory.mkdir(parents=True, exist_ok=True)

    def discard_incomplete(self) -> None:
        """Remove saves a crash interrupted (only the trainer that owns the directory may)."""
        for leftover in self.directory.glob(".tmp-step-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""
        found = (_STEP_DIR.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def save(self, policy: Policy, state: TrainerState) -> Path:
        """Write a checkpoint of `policy` and `state` atomically; returns its directory."""
        final = self.path(state.step)
        tmp = self.directory / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        policy.save(tmp)
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / RNG_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state)))
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (only after a restart): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_path(self.directory)
        for old in self.steps()[: -self.num_kept]:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return final

    def load(self, policy: Policy, path: Path | None = None) -> TrainerState | None:
        """Restore the newest (or the given) checkpoint into `policy`; None if there is none."""
        path = path or self.latest()
        if path is None:
            return None
        policy.load(path)
        rng = torch.load(path / RNG_FILE, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        return TrainerState(**json.loads((path / STATE_FILE).read_text()))
