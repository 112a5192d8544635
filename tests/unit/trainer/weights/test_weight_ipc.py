"""The colocated weight-sync settings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.trainer.model_config import WeightSyncConfig


@pytest.mark.parametrize(("settings", "message"), [
    ({"mode": "colocated_direct"}, "mode=colocated_direct needs engine_urls"),
    ({"mode": "colocated", "rollout_address": ""}, "mode=colocated needs rollout_address"),
    ({"mode": "rollout", "release_engines_during_step": True},
     "release_engines_during_step needs mode colocated or colocated_direct"),
])
def test_colocated_settings_are_checked(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        WeightSyncConfig.model_validate(settings)


def test_colocated_settings_that_work() -> None:
    assert WeightSyncConfig(mode="colocated", release_engines_during_step=True).mode == "colocated"
    direct = WeightSyncConfig(mode="colocated_direct", engine_urls=["http://127.0.0.1:1"])
    assert not direct.release_engines_during_step


def test_colocated_modes_default_to_larger_buckets() -> None:
    assert WeightSyncConfig(mode="colocated").bucket_size_mb == 2048.0
    assert WeightSyncConfig().bucket_size_mb == 512.0  # a broadcast
    assert WeightSyncConfig(mode="colocated", bucket_mb=64).bucket_size_mb == 64.0
