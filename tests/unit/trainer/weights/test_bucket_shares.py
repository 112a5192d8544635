"""What the colocated sync shares per bucket: the same live storages go as they are, pickled
once; anything else is staged in one persistent buffer whose payload is pickled once."""

from __future__ import annotations

import torch
import torch.multiprocessing as torch_mp

from services.common.tensor_payload import decode
from services.trainer.weights.bucket_shares import BucketShares


def shared(*shape: int) -> torch.Tensor:
    torch_mp.set_sharing_strategy("file_system")
    return torch.randn(*shape).share_memory_()


def storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_a_cpu_bucket_is_staged_in_one_shared_buffer_of_the_engine_dtype() -> None:
    bucket = [("a", torch.randn(2, 3)), ("b", torch.randn(4, 2).t())]
    payload, views = BucketShares(torch.bfloat16).share(bucket)
    assert [n for n, _ in views] == ["a", "b"]
    assert len({storage(t) for _, t in views}) == 1
    got = decode(payload, None)
    for name, tensor in bucket:
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor.to(torch.bfloat16))


def test_the_staging_buffer_and_its_payloads_are_reused_every_sync() -> None:
    shares = BucketShares(torch.float32)
    first = [("a", torch.randn(3)), ("b", torch.randn(2, 2))]
    payload, views = shares.share(first)
    _, second = shares.share([("c", torch.randn(5))])  # every bucket uses the same buffer
    assert storage(second[0][1]) == storage(views[0][1])
    # the larger of the two: "b" starts 256 bytes in (common/tensor_layout.py), 64 floats
    assert views[1][1].data_ptr() - views[0][1].data_ptr() == 256
    assert shares.num_bytes == (64 + 4) * 4
    new = [("a", torch.randn(3)), ("b", torch.randn(2, 2))]
    again, _ = shares.share(new)  # the next sync: new values, the same pickle
    assert again == payload
    assert all(torch.equal(decode(again, None)[n], t) for n, t in new)
    shares.share([("d", torch.randn(90))])  # a larger bucket: a new buffer
    assert shares.num_bytes == 90 * 4
    assert shares.share(new)[0] != payload  # pickled again on the new buffer
    assert shares.modes() == {"fresh": 0, "direct": 0, "staged": 2}  # "c" went with the old


def test_the_same_live_storages_go_as_they_are_and_pickled_once() -> None:
    shares = BucketShares(torch.float32)
    params = [("a", shared(3)), ("b", shared(2, 2))]
    _, sent = shares.share(params)  # first sight: as they are, pickled anew
    assert sent is params and shares.modes()["fresh"] == 1
    second, sent = shares.share(params)  # the same storages again: direct from now on
    assert sent is params  # (on CPU the pickle of a file is the same; CUDA's differs)
    params[0][1].add_(1.0)  # the trainer's step writes them in place
    third, sent = shares.share(params)
    assert third == second and sent is params  # no copy, no pickling
    assert torch.equal(decode(third, None)["a"], params[0][1])
    assert shares.num_bytes == 0 and shares.modes() == {"fresh": 0, "direct": 1, "staged": 0}
    moved = [("a", shared(3)), params[1]]  # a storage changed: staged from now on
    payload, views = shares.share(moved)
    assert views is not moved and shares.modes()["staged"] == 1
    assert torch.equal(decode(payload, None)["a"], moved[0][1])
    assert shares.share([("a", shared(3)), params[1]])[0] == payload


def test_new_tensors_every_sync_are_staged_from_the_second_sync() -> None:
    shares = BucketShares(torch.float32)
    payloads = []
    for step in range(4):
        bucket = [("a", shared(4) + step), ("b", shared(2))]  # gathered anew every sync
        bucket = [(n, t.share_memory_()) for n, t in bucket]
        payload, _ = shares.share(bucket)
        payloads.append(payload)
        assert torch.equal(decode(payload, None)["a"], bucket[0][1])
    assert payloads[1] == payloads[2] == payloads[3] != payloads[0]
    assert shares.modes() == {"fresh": 0, "direct": 0, "staged": 1}


def test_staged_tensors_start_where_an_engine_lays_out_its_parameters() -> None:
    from services.common.tensor_layout import ALIGN_BYTES

    bucket = [("a", torch.randn(3)), ("b", torch.randn(128)), ("c", torch.randn(5))]
    _, views = BucketShares(torch.bfloat16).share(bucket)
    base = views[0][1].data_ptr()
    # 3 bf16 end at 6 bytes: "b" starts at the next 256; 128 bf16 are 256 bytes: "c" follows
    assert [t.data_ptr() - base for _, t in views] == [0, ALIGN_BYTES, 2 * ALIGN_BYTES]
