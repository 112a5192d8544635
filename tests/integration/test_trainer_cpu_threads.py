"""`trainer.cpu_threads` sets each rank's torch CPU threads (a machine shared with engines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.testing.engine_process import tiny_model_path
from services.testing.trainer_ranks import run_ranks


def rank_threads(rank: int, world_size: int, master_port: int, model: str,
                 cpu_threads: int) -> int:
    import torch

    from services.trainer.config import TrainerConfig
    from services.trainer.megatron_policy import build_policy

    torch.set_num_threads(3)
    config = TrainerConfig.model_validate({"model": {"hf_path": model, "dtype": "float32"},
                                           "cpu_threads": cpu_threads})
    build_policy(config)
    return int(torch.get_num_threads())


@pytest.mark.slow
def test_cpu_threads_is_applied_and_zero_keeps_torch_default() -> None:
    def threads(cpu_threads: int) -> int:
        (got,) = run_ranks(Path(__file__), "rank_threads", 1, {
            "model": str(tiny_model_path()), "cpu_threads": cpu_threads}, timeout_s=300)
        return int(got)

    assert threads(1) == 1
    assert threads(0) == 3
