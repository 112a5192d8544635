"""Fixtures shared by the whole suite: a real redis-server for the session."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.config import RedisConfig
from services.common.redis_connect import connect
from services.testing.redis_server import RedisServer


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A fresh directory, removed after the test. Not tmp_path: concurrent pytest sessions
    prune each other's old basetemp dirs."""
    path = Path(tempfile.mkdtemp(prefix="riptide-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server on a free loopback port, stopped at the end of the session."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_config(redis_server: RedisServer) -> RedisConfig:
    """The session's Redis (URL, user and password), emptied (FLUSHALL) before each test."""
    with connect(redis_server.config) as client:
        client.flushall()
    return redis_server.config


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests on machines without CUDA (imports torch only if such tests exist)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)
