"""Redis over TLS (`rediss://`): the stack's Redis with a certificate from `riptide tls-cert`
serves a client that trusts the CA and logs in, and refuses plaintext and clients that do not
trust its certificate."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from services.common import process
from services.common.config import RedisConfig
from services.common.redis_connect import connect, pings
from services.local_stack import redis_command
from services.testing.redis_server import find_redis_server, free_port

REPO = Path(__file__).resolve().parents[2]


def test_rediss_with_the_clusters_ca(tmp_path: Path) -> None:
    certs = tmp_path / "tls"
    made = subprocess.run([sys.executable, "-m", "services.cli", "tls-cert", "--out",
                           str(certs), "--host", "127.0.0.1"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    if made.returncode != 0 and "openssl command is not on PATH" in made.stderr:
        pytest.skip("openssl is not installed")
    assert made.returncode == 0, made.stderr
    port = free_port()
    config = RedisConfig(url=f"rediss://127.0.0.1:{port}/0", password=secrets.token_urlsafe(24),
                         tls_ca_file=str(certs / "ca.pem"),
                         tls_cert_file=str(certs / "server.pem"),
                         tls_key_file=str(certs / "server-key.pem"))
    proc = process.spawn(redis_command(find_redis_server(), config, tmp_path / "redis"),
                         log_path=tmp_path / "redis.log")
    try:
        deadline = time.monotonic() + 30
        while not pings(config):
            assert proc.poll() is None, (tmp_path / "redis.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "redis.log").read_text()
            time.sleep(0.1)
        with connect(config) as client:
            assert client.set("k", "v") and client.get("k") == b"v"
        plain = RedisConfig(url=f"redis://127.0.0.1:{port}/0", password=config.password)
        with connect(plain, socket_timeout=2, protocol=2) as client:
            with pytest.raises(redis.ConnectionError):
                client.ping()  # no plaintext port at all
        untrusted = config.model_copy(update={"tls_ca_file": None})  # the system's CAs
        with connect(untrusted, socket_timeout=2) as client:
            with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
                client.ping()
    finally:
        process.stop(proc)

