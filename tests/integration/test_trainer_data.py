"""The trainer's stream reader blocks (never polls) on an empty stream and records the wait."""

from __future__ import annotations

import threading
import time

from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Group, Trajectory
from services.common.buffer import SampleBuffer
from services.common.config import RedisConfig
from services.common.redis_connect import connect
from services.trainer.data.data import GroupStream


def _group(i: int) -> Group:
    sample = Trajectory(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1],
                        rollout_logprobs=[-1.0, -1.0], reward=1.0, status=VERDICT_STATUS_SCORED)
    return Group(group_id=f"g{i}", samples=[sample, sample])


def test_empty_stream_wait_is_blocking_and_counted_as_bubble(redis_config: RedisConfig) -> None:
    buffer = SampleBuffer(redis_config, "data")
    stream = GroupStream(buffer, "trainer-0", 2, True, 1024, block_ms=5000)
    assert buffer.put(_group(0))
    producer = threading.Timer(0.6, lambda: buffer.put(_group(1)))
    client = connect(redis_config)
    client.config_resetstat()
    start = time.monotonic()
    producer.start()
    batch = stream.next_batch(lambda: False, set())
    elapsed = time.monotonic() - start
    assert batch is not None and batch.group_ids == ["g0", "g1"]
    assert 0.5 < batch.wait_s <= elapsed < 3.0
    calls = client.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0)
    assert calls <= 3  # one read got g0, one blocked until g1 arrived: no polling loop
    assert buffer.stats().pending == 2  # read, not acked: the loop acks after a checkpoint


def test_stop_while_waiting_returns_none_and_keeps_what_was_read(redis_config: RedisConfig) -> None:
    buffer = SampleBuffer(redis_config, "data")
    stream = GroupStream(buffer, "trainer-0", 2, True, 1024, block_ms=100)
    assert buffer.put(_group(0))
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    assert stream.next_batch(stop.is_set, set()) is None
    assert buffer.put(_group(1))
    batch = stream.next_batch(lambda: False, set())
    assert batch is not None and batch.group_ids == ["g0", "g1"]
