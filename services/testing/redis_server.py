"""A throwaway redis-server on a free loopback port, for tests and benches.

It requires a login like every Redis Riptide starts (the deployment's redis.conf: an ACL user
with a fresh password, the default user off), but its user may run every command (tests read
CONFIG and FLUSHALL between cases). No persistence (`--save "" --appendonly no`), its own temp
dir, its own process group so that `stop()` and `kill()` reach it and nothing else.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from services.common.config import RedisConfig
from services.common.errors import Unavailable
from services.common.redis_server_config import server_config, write_server_config

INSTALL_HINT = (
    "redis-server is not on PATH; install it with `sudo apt-get install redis-server` "
    "(Debian/Ubuntu) or `brew install redis` (macOS)"
)


def find_redis_server() -> str:
    """The path of the redis-server binary, or Unavailable saying how to install it."""
    path = shutil.which("redis-server")
    if path is None:
        raise Unavailable(INSTALL_HINT)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (callers retry if it is taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether a Redis server answers PING at host:port (PONG, or NOAUTH: it wants a login)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """A redis-server child process on `port` (default: a free one); use as a context manager
    or call `stop()`."""

    def __init__(
        self, host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 10.0,
        password: str | None = None,
    ) -> None:
        self.host = host
        self.port = 0
        self.username = "riptide"
        self.password = password or secrets.token_urlsafe(24)
        self._binary = find_redis_server()
        self._dir = Path(tempfile.mkdtemp(prefix="riptide-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None
        for _ in range(1 if port else 5):  # a free port can be taken between probe and bind
            if self._start(port or free_port(host), start_timeout_s):
                return
        self._cleanup()
        raise Unavailable(f"redis-server did not start on {host}: {self._log_tail()}")

    @property
    def url(self) -> str:
        """Where it listens (no credentials: see `config`)."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def config(self) -> RedisConfig:
        """The [redis] section of a deployment using this server: URL, user and password."""
        return RedisConfig(url=self.url, username=self.username, password=self.password)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _start(self, port: int, timeout_s: float) -> bool:
        login = RedisConfig(url=f"redis://{self.host}:{port}/0", username=self.username,
                            password=self.password)
        conf = write_server_config(self._dir / "redis.conf", server_config(
            login, [self.host], self._dir, user_commands="~* &* +@all"))
        args = [
            self._binary,
            str(conf),
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--logfile", str(self._dir / "redis.log"),
            "--daemonize", "no",
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            if ping(self.host, port):
                self.port = port
                return True
            time.sleep(0.01)
        self._signal(signal.SIGKILL)
        self._cleanup()
        raise Unavailable(f"redis-server on port {port} not ready after {timeout_s}s")

    def _log_tail(self) -> str:
        try:
            return (self._dir / "redis.log").read_text()[-2000:] or "(empty log)"
        except OSError:
            return "(no log)"

    def _signal(self, sig: signal.Signals, wait_s: float = 5.0) -> bool:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return True
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return True
        try:
            proc.wait(timeout=wait_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        """SIGKILL the server (to test crashes); its temp dir stays until `stop()`."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its temp dir."""
        if not self._signal(signal.SIGTERM):
            self._signal(signal.SIGKILL)
        self._cleanup()

    def _cleanup(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
