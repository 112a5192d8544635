"""The colocated sender's buckets and the colocated weight-sync settings."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from services.common.tensor_payload import decode
from services.trainer.model_config import WeightSyncConfig
from services.trainer.weights.weight_ipc import share_bucket


def test_a_cpu_bucket_is_packed_into_one_shared_buffer_of_the_engine_dtype() -> None:
    bucket = [("a", torch.randn(2, 3)), ("b", torch.randn(4).t())]
    payload, shared = share_bucket(bucket, torch.bfloat16)
    assert [n for n, _ in shared] == ["a", "b"]
    assert len({t.untyped_storage().data_ptr() for _, t in shared}) == 1
    got = decode(payload, None)
    for name, tensor in bucket:
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor.to(torch.bfloat16))


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
