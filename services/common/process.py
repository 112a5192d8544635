"""Child processes that cannot outlive their parent, stopped by process group."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:  # not Linux: the parent's cleanup still stops the group
        pass


def spawn(cmd: Sequence[str], *, log_path: Path | None = None, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new session that gets SIGTERM when this process dies."""
    out: IO[bytes] | int = subprocess.DEVNULL
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(
            list(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, preexec_fn=_die_with_parent,  # noqa: PLW1509
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
