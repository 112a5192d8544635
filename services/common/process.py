"""Child processes that cannot outlive their parent, stopped by process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from services.common.errors import RiptideError

# Runs in the child before the real command: ask the kernel for SIGTERM when the parent dies
# (PR_SET_PDEATHSIG), give up if the parent is already gone, then exec. A shim instead of
# preexec_fn because forking a process with gRPC threads must not run Python before exec.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "except OSError:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def spawn(cmd: Sequence[str], *, log_path: Path | None = None, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new session that gets SIGTERM when this process dies."""
    out: IO[bytes] | int = subprocess.DEVNULL
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True,
        )
    finally:
        if not isinstance(out, int):
            out.close()


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> int | None:
    """SIGTERM the child's process group, wait `grace_s`, then SIGKILL what is left."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    # Also reap grandchildren that stayed in the group after the leader exited.
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        return proc.wait(5)
    except subprocess.TimeoutExpired:
        return None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_until_ready(probe: Callable[[], bool], child: subprocess.Popen[bytes], name: str,
                     timeout_s: float, detail: Callable[[], str],
                     interval_s: float = 0.2) -> None:
    """Poll `probe` until it holds; RiptideError if `child` exits or `timeout_s` passes first,
    with `detail()` (a log tail, a log path) appended."""
    deadline = time.monotonic() + timeout_s
    while not probe():
        if child.poll() is not None:
            raise RiptideError(f"{name} exited with code {child.returncode} while starting; "
                               f"{detail()}")
        if time.monotonic() > deadline:
            raise RiptideError(f"{name} not ready after {timeout_s:.0f}s; {detail()}")
        time.sleep(interval_s)
