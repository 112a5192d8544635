"""An HTTP server started as a child process that writes its bound port to a ready file.

The base of the test and bench helpers that run the built-in or the simulated engine: start
the command in its own process group, wait until the port is written (or the child dies),
and stop or kill exactly that group.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from services.common import process
from services.common.errors import Unavailable

REPO = Path(__file__).resolve().parents[2]


class ChildServer:
    """Runs `cmd + ["--ready-file", F]` and waits until the child wrote its port to F."""

    name = "server"
    stop_grace_s = 5.0

    def __init__(self, cmd: list[str], start_timeout_s: float,
                 env: dict[str, str] | None = None) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix=f"riptide-{self.name}-"))
        ready = self._dir / "port"
        self.proc = process.spawn([*cmd, "--ready-file", str(ready)],
                                  log_path=self._dir / f"{self.name}.log", cwd=REPO, env=env)
        self.deadline = time.monotonic() + start_timeout_s
        # The child writes the file in one call, but it may be seen empty before the write.
        while not ready.exists() or not ready.read_text().strip():
            self.check_starting("did not start")
            time.sleep(0.02)
        self.port = int(ready.read_text())
        self.url = f"http://127.0.0.1:{self.port}"

    def check_starting(self, what: str) -> None:
        """Stop and raise if the child died or the start deadline passed."""
        if self.proc.poll() is not None or time.monotonic() > self.deadline:
            tail = self.log_tail()
            self.stop()
            raise Unavailable(f"{self.name} {what}: {tail}")

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return (self._dir / f"{self.name}.log").read_text()[-num_chars:]
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (a crash)."""
        process.stop(self.proc, grace_s=0)

    def stop(self) -> None:
        """Stop the server's process group, then remove its folder."""
        process.stop(self.proc, grace_s=self.stop_grace_s)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


async def serve_until_terminated(ready_file: str, port: int) -> None:
    """The child's side: say its port (the parent waits for the file), then serve until
    SIGTERM."""
    Path(ready_file).write_text(str(port))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
