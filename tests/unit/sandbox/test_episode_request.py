"""RunEpisode requests are range-checked before any sandbox is made."""

from __future__ import annotations

import pytest

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.errors import InvalidRequest
from services.sandbox.service import check_episode_request

GOOD = {"task_id": "t", "sample_id": "s", "group_id": "g"}
CAP = 4096  # the agent's max_context_tokens
Sampling = common_pb2.SamplingParams


@pytest.mark.parametrize(("fields", "message"), [
    ({"task_id": ""}, "task_id is empty: ListTasks lists the tasks"),
    ({"sample_id": ""}, "RunEpisode needs a sample_id"),
    ({"sample_id": "s" * 100_000}, "sample_id: at most 256 printable characters, got sss"),
    ({"group_id": "g\n\x00"}, "group_id: at most 256 printable characters"),
    ({"task_id": "t" * 300}, "(300 chars)"),
    ({"sampling_params": Sampling(temperature=-1)}, "temperature: must be in [0, 100]"),
    ({"sampling_params": Sampling(top_p=3)}, "top_p: must be in [0, 1]"),
    ({"sampling_params": Sampling(top_k=-9)}, "top_k: must be -1 (all), 0 (default) or more"),
    ({"sampling_params": Sampling(stop_token_ids=[-4])}, "token ids are never negative"),
    ({"sampling_params": Sampling(stop=["x"] * 300)}, "at most 256 stop strings"),
    ({"sampling_params": Sampling(stop=[""])}, "each stop string has 1 to 1024 characters"),
    ({"sampling_params": Sampling(max_new_tokens=0)}, "max_new_tokens: 0 generates nothing"),
    ({"sampling_params": Sampling(max_new_tokens=2**32 - 1)},
     "max_new_tokens: 4294967295 is more than the agent's context cap "
     "(sandbox.agent.max_context_tokens = 4096)"),
    ({"sampling_params": Sampling(max_new_tokens=4097)}, "more than the agent's context cap"),
])
def test_bad_requests_are_named(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_episode_request(sandbox_pb2.RunEpisodeRequest(**{**GOOD, **fields}), CAP)
    assert message in str(info.value) and len(str(info.value)) < 200, str(info.value)


def test_a_good_request_passes() -> None:
    check_episode_request(sandbox_pb2.RunEpisodeRequest(
        **GOOD, sample_index=3, sampling_params=Sampling(temperature=0.8, max_new_tokens=64,
                                                         stop=["\n$ "], sampling_seed=7)),
        CAP)
    # unset: the agent's per-turn default; the whole context at most
    check_episode_request(sandbox_pb2.RunEpisodeRequest(**GOOD), CAP)
    check_episode_request(sandbox_pb2.RunEpisodeRequest(
        **GOOD, sampling_params=Sampling(max_new_tokens=CAP)), CAP)
