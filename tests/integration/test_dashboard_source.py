"""The dashboard's live source over a real Redis: incremental reads, episode lookups."""

from __future__ import annotations

import asyncio
import json

import redis

from services.common.config import RedisConfig
from services.common.events import episodes_key, events_key
from services.common.redis_connect import connect
from services.rollout.dashboard.source import SCAN_CHUNK, RedisSource
from services.testing.synthetic_events import SyntheticRun


def _write(client: redis.Redis, run: str, entries: list[tuple[str, dict]]) -> None:
    for stream, data in entries:
        if stream == "events":
            client.xadd(events_key(run), {"event": json.dumps(data)})
        else:
            client.xadd(episodes_key(run), {"episode": json.dumps(data)})


def test_reads_new_events_only_and_finds_episodes(redis_config: RedisConfig) -> None:
    entries = SyntheticRun(num_steps=15).generate()
    events = [e for e in entries if e[0] == "events"]
    episodes = [e[1] for e in entries if e[0] == "episodes"]
    assert len(episodes) > 2 * SCAN_CHUNK  # lookups cross scan chunks
    half = len(entries) // 2
    client = connect(redis_config)
    _write(client, "r", entries[:half])
    client.xadd(events_key("r"), {"event": b"{not json"})

    async def scenario() -> None:
        source = RedisSource(redis_config, "r")
        try:
            first = len((await source.refresh()).events)
            _write(client, "r", entries[half:])
            record = await source.refresh()
            assert len(record.events) == len(events) and first < len(events)
            assert record.num_bad == 1
            assert len((await source.refresh()).events) == len(events)  # nothing read twice
            newest, oldest = episodes[-1], episodes[0]
            for wanted in (newest, oldest, episodes[len(episodes) // 2], newest):
                found = await source.episode(wanted["sample_id"])
                assert found is not None and found["sample_id"] == wanted["sample_id"]
            assert await source.episode("no-such-sample") is None
        finally:
            await source.aclose()

    asyncio.run(scenario())


def test_a_finished_run_in_redis_is_not_live_but_still_followed(redis_config: RedisConfig) -> None:
    import time

    client = connect(redis_config)
    _write(client, "finished", SyntheticRun(num_steps=2).generate())  # events of long ago

    async def scenario() -> None:
        source = RedisSource(redis_config, "finished")
        try:
            await source.refresh()
            assert not source.live and source.follows
            client.xadd(events_key("finished"), {"event": json.dumps(
                {"kind": "rollout.load", "service": "rollout", "start": time.time(),
                 "attrs": {}})})  # the run resumed: a fresh reading
            await source.refresh()
            assert source.live
        finally:
            await source.aclose()

    asyncio.run(scenario())
