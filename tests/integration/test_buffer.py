"""The sample buffer against a real redis-server: idempotent puts, crash-safe consumption,
backpressure and a clear error when Redis is down."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from services._proto.riptide.v1 import common_pb2
from services.common.buffer import AsyncSampleBuffer, SampleBuffer
from services.common.config import RedisConfig
from services.common.errors import Backpressure, Unavailable
from services.common.redis_connect import connect
from services.testing.redis_server import RedisServer, free_port

REPO = Path(__file__).resolve().parents[2]
RUN = "test"


def make_group(group_id: str, num_samples: int = 2, num_tokens: int = 64) -> common_pb2.Group:
    group = common_pb2.Group(group_id=group_id, task_id="task-a", min_weight_version=3)
    for index in range(num_samples):
        group.samples.add(
            sample_id=f"{group_id}/{index}",
            group_id=group_id,
            sample_index=index,
            prompt_ids=list(range(num_tokens)),
            response_ids=[7] * num_tokens,
            loss_mask=[1, 0] * (num_tokens // 2),
            rollout_logprobs=[-0.5, 0.0] * (num_tokens // 2),
            weight_versions=[3, -1] * (num_tokens // 2),
            reward=float(index),
            status=common_pb2.VERDICT_STATUS_SCORED,
        )
    return group


def open_buffer(config: RedisConfig | str, max_groups: int = 64) -> SampleBuffer:
    """A buffer of the given server (a bare URL: one without a password)."""
    config = RedisConfig(url=config) if isinstance(config, str) else config
    return SampleBuffer(config.model_copy(update={"max_groups": max_groups,
                                                  "connect_timeout_s": 1.0}), RUN)


def test_put_read_ack_round_trip(redis_config: RedisConfig) -> None:
    buffer = open_buffer(redis_config)
    groups = [make_group(f"g{i}") for i in range(3)]
    assert all(buffer.put(group) for group in groups)
    entries = buffer.read("c1", count=10)
    assert [group for _, group in entries] == groups
    assert buffer.stats().pending == 3
    assert buffer.ack([entry_id for entry_id, _ in entries]) == 3
    assert buffer.stats().length == 0  # acknowledged entries are deleted, not kept
    assert buffer.read("c1", count=10, block_ms=50) == []


def test_put_is_idempotent_across_producer_retries(redis_config: RedisConfig) -> None:
    group = make_group("g-retry")
    assert open_buffer(redis_config).put(group) is True
    assert open_buffer(redis_config).put(group) is False  # a restarted producer retrying

    async def async_retry() -> bool:
        producer = await AsyncSampleBuffer.connect(redis_config, RUN)
        try:
            return await producer.put(group)
        finally:
            await producer.aclose()

    assert asyncio.run(async_retry()) is False
    consumer = open_buffer(redis_config)
    entries = consumer.read("c1", count=10)
    assert [g.group_id for _, g in entries] == ["g-retry"]
    consumer.ack([entries[0][0]])
    assert consumer.put(group) is False  # still a duplicate after it was consumed
    assert consumer.stats().length == 0


def test_concurrent_retries_write_each_group_once(redis_config: RedisConfig) -> None:
    buffer = open_buffer(redis_config)
    groups = [make_group(f"g{i}") for i in range(4)]
    results: list[bool] = []
    lock = threading.Lock()

    def producer() -> None:
        own = open_buffer(redis_config)
        for group in groups:
            written = own.put(group)
            with lock:
                results.append(written)

    threads = [threading.Thread(target=producer) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(True) == len(groups)
    ids = Counter(g.group_id for _, g in buffer.read("c1", count=100))
    assert ids == Counter({group.group_id: 1 for group in groups})


CHILD = """
import json, os, sys, time
from services.common.buffer import SampleBuffer
from services.common.config import RedisConfig
buffer = SampleBuffer(RedisConfig(url=sys.argv[1], password=os.environ["RIPTIDE_REDIS_PASSWORD"]),
                      sys.argv[2])
entries = buffer.read("doomed", count=5)
acked = [entry_id for entry_id, _ in entries[:2]]
buffer.ack(acked)  # the first two made it into a checkpoint
print(json.dumps({"read": [[i, g.group_id] for i, g in entries], "acked": acked}), flush=True)
time.sleep(600)
"""


def test_consumer_killed_mid_batch_loses_nothing_and_counts_nothing_twice(
    redis_config: RedisConfig,
) -> None:
    buffer = open_buffer(redis_config)
    all_ids = [f"g{i}" for i in range(12)]
    for group_id in all_ids:
        buffer.put(make_group(group_id))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, redis_config.url, RUN],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO),
             "RIPTIDE_REDIS_PASSWORD": str(redis_config.password)},
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None
        report = json.loads(child.stdout.readline())
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    assert len(report["read"]) == 5
    consumed = Counter(gid for entry_id, gid in report["read"] if entry_id in report["acked"])

    assert buffer.reclaim("survivor", min_idle_ms=60_000) == []  # not idle long enough yet
    fresh = buffer.read("survivor", count=100)
    assert len(fresh) == 7
    time.sleep(0.1)
    for entry_id, group in fresh:
        assert buffer.ack([entry_id]) == 1
        consumed[group.group_id] += 1
    reclaimed = buffer.reclaim("survivor", min_idle_ms=50)
    assert sorted(i for i, _ in reclaimed) == sorted(
        i for i, _ in report["read"] if i not in report["acked"]
    )
    for entry_id, group in reclaimed:
        assert buffer.ack([entry_id]) == 1
        consumed[group.group_id] += 1

    assert consumed == Counter({group_id: 1 for group_id in all_ids})
    assert buffer.ack(report["acked"]) == 0  # already acknowledged: not counted again
    assert buffer.reclaim("survivor", min_idle_ms=0) == []
    assert buffer.read("survivor", count=100) == []
    stats = buffer.stats()
    assert (stats.length, stats.pending) == (0, 0)


def test_ack_of_an_unread_entry_deletes_nothing(redis_config: RedisConfig) -> None:
    buffer = open_buffer(redis_config)
    buffer.put(make_group("g0"))
    entries: Any = connect(redis_config).xrange(f"riptide:{RUN}:samples")
    entry_id = entries[0][0].decode()
    assert buffer.ack([entry_id]) == 0
    assert [g.group_id for _, g in buffer.read("c1")] == ["g0"]


def test_put_waits_when_full_then_raises_backpressure(redis_config: RedisConfig) -> None:
    buffer = open_buffer(redis_config, max_groups=2)
    assert buffer.put(make_group("g0")) and buffer.put(make_group("g1"))
    started = time.monotonic()
    with pytest.raises(Backpressure, match="max_groups=2"):
        buffer.put(make_group("g2"), timeout_s=0.3)
    assert 0.3 <= time.monotonic() - started < 5.0

    (entry_id, _), *_ = buffer.read("c1", count=1)
    with pytest.raises(Backpressure):  # read but not acknowledged still takes a slot
        buffer.put(make_group("g2"), timeout_s=0.1)

    def ack_later() -> None:
        time.sleep(0.3)
        open_buffer(redis_config).ack([entry_id])

    thread = threading.Thread(target=ack_later)
    thread.start()
    started = time.monotonic()
    assert buffer.put(make_group("g2"), timeout_s=5.0) is True
    assert time.monotonic() - started >= 0.25
    thread.join()
    assert buffer.stats().length == 2


def test_async_producer_backpressure(redis_config: RedisConfig) -> None:
    async def scenario() -> None:
        capped = redis_config.model_copy(update={"max_groups": 1})
        producer = await AsyncSampleBuffer.connect(capped, RUN)
        try:
            assert await producer.put(make_group("g0"))
            with pytest.raises(Backpressure):
                await producer.put(make_group("g1"), timeout_s=0.2)
            assert (await producer.stats()).length == 1
        finally:
            await producer.aclose()

    asyncio.run(scenario())
    assert [g.group_id for _, g in open_buffer(redis_config).read("c1", count=5)] == ["g0"]


def test_unreachable_redis_fails_fast_with_a_clear_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(Unavailable, match="redis-server") as info:
        open_buffer(url)
    assert url in str(info.value)
    with pytest.raises(Unavailable, match=url):
        asyncio.run(AsyncSampleBuffer.connect(RedisConfig(url=url, connect_timeout_s=1.0), RUN))
    assert time.monotonic() - started < 5.0


@pytest.mark.timeout(30)  # without a socket timeout this would hang
def test_hung_redis_fails_within_the_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (kernel backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        started = time.monotonic()
        with pytest.raises(Unavailable, match=url):
            open_buffer(url)
        assert time.monotonic() - started < 5.0


def test_redis_crash_surfaces_as_unavailable() -> None:
    with RedisServer() as server:
        buffer = open_buffer(server.config)
        assert buffer.put(make_group("g0"))
        server.kill()
        started = time.monotonic()
        with pytest.raises(Unavailable, match=server.url):
            buffer.put(make_group("g1"))
        with pytest.raises(Unavailable):
            buffer.read("c1")
        assert time.monotonic() - started < 5.0


def test_producers_reconnect_after_a_redis_restart() -> None:
    with RedisServer() as first:
        config = first.config.model_copy(update={"connect_timeout_s": 1.0})
        producer = SampleBuffer(config, RUN)
        loop = asyncio.new_event_loop()
        async_producer = loop.run_until_complete(AsyncSampleBuffer.connect(config, RUN))
        assert producer.put(make_group("g0"))
        assert loop.run_until_complete(async_producer.put(make_group("g1")))
        first.kill()
        # Pooled connections are now stale.
        with RedisServer(port=first.port, password=first.password):
            assert producer.put(make_group("g2"))
            assert loop.run_until_complete(async_producer.put(make_group("g3")))
        loop.run_until_complete(async_producer.aclose())
        loop.close()
