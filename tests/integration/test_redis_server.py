"""The throwaway redis-server used by tests, benches and the local stack."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from services.common.errors import Unavailable
from services.common.redis_connect import connect
from services.testing.redis_server import RedisServer, ping


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_starts_on_loopback_without_persistence_and_stops_cleanly() -> None:
    server = RedisServer()
    pid = server.pid
    assert pid is not None and alive(pid)
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    with redis.Redis.from_url(server.url, protocol=2) as anonymous:
        with pytest.raises(redis.AuthenticationError, match="Authentication required"):
            anonymous.ping()  # like every Redis Riptide starts: a login or nothing
    with connect(server.config, decode_responses=True) as client:
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        workdir = Path(client.config_get("dir")["dir"])
    assert workdir.is_dir()
    server.stop()
    assert not alive(pid)
    assert not workdir.exists()
    assert not ping(server.host, server.port)


def test_kill_is_a_crash() -> None:
    with RedisServer() as server:
        assert ping(server.host, server.port)
        server.kill()
        assert server.pid is not None and not alive(server.pid)
        assert not ping(server.host, server.port)


def test_missing_binary_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(Unavailable, match="apt-get install redis-server"):
        RedisServer()
