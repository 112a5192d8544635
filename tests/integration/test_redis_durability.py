"""The local stack's Redis loses no acknowledged sample when it is SIGKILLed mid-write: a
writer puts groups through the real SampleBuffer as fast as it can, Redis is killed under
it, and the restarted server (the same command on the same data) holds every group whose put
returned, in the stream and with its dedup marker."""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from pathlib import Path

import pytest
import redis

from services.common import process
from services.common.buffer import SampleBuffer
from services.common.config import RedisConfig
from services.common.redis_connect import connect
from services.local_stack import redis_command
from services.testing.redis_server import find_redis_server, free_port, ping


def _start(cmd: list[str], port: int, log: Path) -> process.subprocess.Popen[bytes]:
    proc = process.spawn(cmd, log_path=log)
    deadline = time.monotonic() + 20
    while not ping("127.0.0.1", port):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc


def test_sigkill_loses_no_acknowledged_put(tmp_path: Path) -> None:
    port = free_port()
    login = RedisConfig(url=f"redis://127.0.0.1:{port}/0", password=secrets.token_urlsafe(24))
    cmd = redis_command(find_redis_server(), login, tmp_path)
    proc = _start(cmd, port, tmp_path / "redis.log")
    acked: list[str] = []
    started = threading.Event()

    def write() -> None:
        config = login.model_copy(update={"max_groups": 100_000, "connect_timeout_s": 1})
        buffer = SampleBuffer(config, "d")
        try:
            for i in range(100_000):
                group_id = f"g{i:06d}"
                if not buffer.put_serialized(group_id, b"x" * 2000, timeout_s=1):
                    return
                acked.append(group_id)
                if i == 50:
                    started.set()
        except Exception:  # noqa: BLE001 - the kill ends the writer
            return
        finally:
            started.set()

    writer = threading.Thread(target=write)
    writer.start()
    assert started.wait(30)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    writer.join(60)
    proc.wait(10)
    assert len(acked) > 50
    proc = _start(cmd, port, tmp_path / "redis-2.log")
    try:
        client = connect(login)
        stream = client.xrange("riptide:d:samples")
        in_stream = {fields[b"group_id"].decode() for _, fields in stream}
        missing = [g for g in acked if g not in in_stream]
        assert missing == [], f"{len(missing)} acknowledged puts lost, first {missing[:3]}"
        assert all(client.exists(f"riptide:d:group:{g}") for g in acked[-20:])
        # The deployment's user may not run CONFIG: the setting is read from the file.
        assert "appendfsync always" in (tmp_path / "redis.conf").read_text().splitlines()
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.config_get("appendfsync")
    finally:
        process.stop(proc)
