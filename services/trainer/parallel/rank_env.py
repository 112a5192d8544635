"""Where a trainer rank started by the cluster's launcher stands: rank, world and rendezvous.

With `trainer.parallel.launcher = "external"` every rank of the trainer is a process of its
own, started on its node by srun, torchrun or mpirun with `riptide serve trainer`. This reads
the usual variables: RANK / WORLD_SIZE / LOCAL_RANK (torchrun), falling back to Slurm's
SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, plus MASTER_ADDR and MASTER_PORT (rank 0's host
and a free port there, where the ranks meet). Rank 0 becomes the trainer service; the others
follow its commands (worker.py). Used by services/cli.py and service.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from services.common.errors import ConfigError

_SOURCES = {
    "rank": ("RANK", "SLURM_PROCID"),
    "world_size": ("WORLD_SIZE", "SLURM_NTASKS"),
    "local_rank": ("LOCAL_RANK", "SLURM_LOCALID"),
}


@dataclass(frozen=True)
class LaunchedRank:
    """One externally launched trainer rank."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((env[n] for n in names if env.get(n, "") != ""), None)


def _as_int(name: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
    if number < minimum:
        raise ConfigError(f"{name}={number} must be at least {minimum}")
    return number


def launched_rank(env: Mapping[str, str] | None = None) -> LaunchedRank:
    """This process's rank from its environment; ConfigError names what is missing or wrong."""
    env = os.environ if env is None else env
    values: dict[str, int] = {}
    for field, names in _SOURCES.items():
        raw = _first(env, names)
        if raw is None and field == "local_rank":
            raw = "0"
        if raw is None:
            raise ConfigError(
                f"trainer.parallel.launcher is 'external' but neither {' nor '.join(names)} is "
                "set; start every rank with srun or torchrun, or use launcher = 'local'"
            )
        values[field] = _as_int(names[0] if names[0] in env else names[-1], raw,
                                1 if field == "world_size" else 0)  # fmt: skip
    if values["rank"] >= values["world_size"]:
        raise ConfigError(f"rank {values['rank']} is outside a world of {values['world_size']}")
    addr = env.get("MASTER_ADDR", "")
    port = env.get("MASTER_PORT", "")
    if not addr or not port:
        raise ConfigError(
            "trainer.parallel.launcher is 'external' but MASTER_ADDR and MASTER_PORT are not "
            "both set; export rank 0's host and a free port on it to every rank"
        )
    return LaunchedRank(
        rank=values["rank"],
        world_size=values["world_size"],
        local_rank=values["local_rank"],
        master_addr=addr,
        master_port=_as_int("MASTER_PORT", port, 1),
    )
