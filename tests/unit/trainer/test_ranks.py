"""What the trainer service's ranks accept: world size from the parallel config, layouts it
cannot train rejected up front, one shard folder per rank."""

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


@pytest.mark.parametrize("field", ["pipeline_parallel", "context_parallel", "expert_parallel"])
def test_other_layouts_are_config_errors(field: str) -> None:
    config = TrainerConfig.model_validate({"parallel": {field: 2}})
    with pytest.raises(ConfigError, match=field):
        service_world_size(config)


def test_shard_dir_per_rank(tmp_path: Path) -> None:
    assert shard_dir(tmp_path, 0) == tmp_path / "rank-00000"
    assert shard_dir(tmp_path, 12) != shard_dir(tmp_path, 1)
