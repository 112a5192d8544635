"""Externally launched trainer ranks read torchrun's or Slurm's variables, and a missing or
wrong one is a ConfigError that names it."""

from __future__ import annotations

import pytest

from services.common.errors import ConfigError
from services.trainer.parallel.rank_env import LaunchedRank, launched_rank

MASTER = {"MASTER_ADDR": "node0", "MASTER_PORT": "29511"}


def test_torchrun_variables() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", **MASTER}
    assert launched_rank(env) == LaunchedRank(3, 8, 1, "node0", 29511)


def test_slurm_variables_when_torchrun_ones_are_absent() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", **MASTER}
    assert launched_rank(env) == LaunchedRank(5, 16, 1, "node0", 29511)
    # torchrun's variables win where both are set (torchrun inside a Slurm allocation).
    env |= {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}
    assert launched_rank(env) == LaunchedRank(0, 4, 0, "node0", 29511)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "2", **MASTER}, "neither RANK nor SLURM_PROCID"),
        ({"RANK": "0", **MASTER}, "neither WORLD_SIZE nor SLURM_NTASKS"),
        ({"RANK": "2", "WORLD_SIZE": "2", **MASTER}, "rank 2 is outside a world of 2"),
        ({"RANK": "x", "WORLD_SIZE": "2", **MASTER}, "RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "0", **MASTER}, "WORLD_SIZE=0 must be at least 1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR and MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}, "MASTER_ADDR and MASTER_PORT"),
    ],
)
def test_missing_or_wrong_variables_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        launched_rank(env)
