"""What the trainer service's ranks accept: world size from the parallel config (TP x PP x
CP x DP), layouts it cannot train rejected up front, one shard folder per rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.trainer.config import TrainerConfig
from services.trainer.ranks import service_world_size, shard_dir


def test_world_size_is_tp_times_dp() -> None:
    assert service_world_size(TrainerConfig()) == 1
    parallel = {"tensor_parallel": 2, "data_parallel": 3}
    assert service_world_size(TrainerConfig.model_validate({"parallel": parallel})) == 6
    parallel = {"tensor_parallel": 2, "context_parallel": 2, "data_parallel": 3}
    assert service_world_size(TrainerConfig.model_validate({"parallel": parallel})) == 12
    parallel = {"tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel": 2}
    assert service_world_size(TrainerConfig.model_validate({"parallel": parallel})) == 8


def test_pipeline_with_context_parallel_is_accepted() -> None:
    parallel = {"pipeline_parallel": 2, "context_parallel": 2, "data_parallel": 2}
    assert service_world_size(TrainerConfig.model_validate({"parallel": parallel})) == 8


def test_expert_parallel_takes_its_ranks_from_data_parallel() -> None:
    parallel = {"expert_parallel": 2, "data_parallel": 4}
    assert service_world_size(TrainerConfig.model_validate({"parallel": parallel})) == 4
    for dp in (None, 3):
        parallel = {"expert_parallel": 2, "data_parallel": dp}
        with pytest.raises(ConfigError, match="expert_parallel=2"):
            service_world_size(TrainerConfig.model_validate({"parallel": parallel}))


def test_shard_dir_per_rank(tmp_path: Path) -> None:
    assert shard_dir(tmp_path, 0) == tmp_path / "rank-00000"
    assert shard_dir(tmp_path, 12) != shard_dir(tmp_path, 1)
