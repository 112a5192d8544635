"""How the sample buffer encodes groups and reads Redis replies, without a server."""

from __future__ import annotations

import pytest
import redis

from services._proto.riptide.v1 import common_pb2
from services.common.buffer import (
    BufferStats,
    _BufferBase,
    decode,
    payloads,
    redact,
)
from services.common.config import RedisConfig
from services.common.errors import InvalidRequest


def full_group() -> common_pb2.Group:
    group = common_pb2.Group(
        group_id="grp-é-1", task_id="tbench/fix-git", created_unix_ms=1_700_000_000_123,
        min_weight_version=41,
    )  # fmt: skip
    traj = group.samples.add(
        sample_id="grp-é-1/0", group_id="grp-é-1", task_id="tbench/fix-git", sample_index=0,
        prompt_ids=[0, 151_551, 2**31 - 1], response_ids=[5, 6, 7, 8],
        loss_mask=[1, 1, 0, 1], rollout_logprobs=[-0.125, -3.5, 0.0, -1e-7],
        weight_versions=[41, 42, -1, 2**40], reward=1.0,
        status=common_pb2.VERDICT_STATUS_SCORED, num_turns=3, finish_reason="complete",
    )  # fmt: skip
    traj.timings.generate_s = 12.5
    group.samples.add(status=common_pb2.VERDICT_STATUS_NO_VERDICT, status_message="timeout")
    return group


def test_a_group_survives_the_stream_encoding_exactly() -> None:
    group = full_group()
    data = group.SerializeToString()
    reply = [
        [b"1-0", [b"group", data, b"group_id", group.group_id.encode()]],
        None,  # deleted while pending (XAUTOCLAIM on older servers)
        [b"2-0", None],
        [b"3-0", [b"group_id", b"x", b"group", data]],  # field order does not matter
    ]
    entries = decode(payloads(reply))
    assert [entry_id for entry_id, _ in entries] == ["1-0", "3-0"]
    decoded = entries[0][1]
    assert decoded == group
    assert list(decoded.samples[0].weight_versions) == [41, 42, -1, 2**40]
    assert list(decoded.samples[0].rollout_logprobs)[:2] == [-0.125, -3.5]
    assert decoded.samples[1].status == common_pb2.VERDICT_STATUS_NO_VERDICT


def test_put_sends_the_payload_without_copying_it() -> None:
    base = _BufferBase(RedisConfig(max_groups=7), "run-1", dedup_ttl_s=60)
    payload = full_group().SerializeToString()
    commands = base._put_commands("g1", payload)
    assert [c[0] for c in commands] == ["WATCH", "EVAL", "MULTI", "XADD", "SET", "EXEC"]
    assert commands[0] == ("WATCH", "riptide:run-1:group:g1")
    assert commands[1][2:] == (2, "riptide:run-1:group:g1", "riptide:run-1:samples", 7)
    xadd = commands[3]
    assert xadd[:2] == ("XADD", "riptide:run-1:samples")
    assert xadd[xadd.index("group") + 1] is payload


def test_a_group_without_an_id_is_refused() -> None:
    base = _BufferBase(RedisConfig(), "run-1", dedup_ttl_s=60)
    with pytest.raises(InvalidRequest, match="group_id"):
        base._put_commands("", b"payload")


@pytest.mark.parametrize(
    ("gate", "committed", "outcome"),
    [(1, [b"1-0", b"OK"], 1), (0, None, 0), (-1, None, -1), (1, None, None)],
)
def test_put_outcome(gate: int, committed: list[bytes] | None, outcome: int | None) -> None:
    assert _BufferBase._outcome([b"OK", gate, b"OK", b"QUEUED", b"QUEUED", committed]) == outcome


def test_an_error_inside_the_transaction_is_raised() -> None:
    error = redis.ResponseError("OOM command not allowed")
    with pytest.raises(redis.ResponseError, match="OOM"):
        _BufferBase._outcome([b"OK", 1, b"OK", b"QUEUED", b"QUEUED", [error, b"OK"]])


def test_redact_hides_the_password() -> None:
    assert redact("redis://:s3cret@10.0.0.5:6379/0") == "redis://:***@10.0.0.5:6379/0"
    assert redact("redis://user:pw@host:1/2") == "redis://user:***@host:1/2"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_stats_unread_is_length_minus_pending() -> None:
    assert BufferStats(length=10, pending=3, max_groups=16).unread == 7
