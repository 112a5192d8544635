"""Fixtures shared by the whole suite: a real redis-server for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from services.testing.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server on a free loopback port, stopped at the end of the session."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis URL, emptied (FLUSHALL) before each test."""
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    return redis_server.url
