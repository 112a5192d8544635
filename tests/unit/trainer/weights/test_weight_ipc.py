"""The colocated sender's buckets and the colocated weight-sync settings."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from services.common.tensor_payload import decode
from services.trainer.model_config import WeightSyncConfig
from services.trainer.weights.weight_ipc import StagingBuffer


def test_a_cpu_bucket_is_copied_into_one_shared_buffer_of_the_engine_dtype() -> None:
    bucket = [("a", torch.randn(2, 3)), ("b", torch.randn(4, 2).t())]
    payload, shared = StagingBuffer(torch.bfloat16).share(bucket)
    assert [n for n, _ in shared] == ["a", "b"]
    assert len({t.untyped_storage().data_ptr() for _, t in shared}) == 1
    got = decode(payload, None)
    for name, tensor in bucket:
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor.to(torch.bfloat16))


def test_the_staging_buffer_and_payload_are_reused_every_sync() -> None:
    staging = StagingBuffer(torch.float32)
    first = [("a", torch.randn(3)), ("b", torch.randn(2, 2))]
    second = [("c", torch.randn(5))]
    payload_a, views = staging.share(first)
    _, second_views = staging.share(second)  # every bucket goes through the same buffer
    storage = views[0][1].untyped_storage().data_ptr()
    assert second_views[0][1].untyped_storage().data_ptr() == storage
    assert staging.num_bytes == 7 * 4  # the larger of the two
    new = [("a", torch.randn(3)), ("b", torch.randn(2, 2))]
    again, views = staging.share(new)  # the next sync: new values, the same pickle
    assert again == payload_a
    assert all(torch.equal(decode(again, None)[n], t) for n, t in new)
    staging.share([("d", torch.randn(9))])  # a larger bucket: a new buffer
    assert staging.num_bytes == 9 * 4
    assert staging.share(new)[0] != payload_a  # pickled again on the new buffer


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
