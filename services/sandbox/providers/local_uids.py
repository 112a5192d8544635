"""Host uids for local sandboxes: one unprivileged uid per live sandbox, when run as root.

A uid of its own makes the sandbox's RLIMIT_NPROC count only its own processes (the kernel
exempts uid 0 from that limit) and lets delete find every process of a sandbox by its uid.
Uids are leased with a lock file each, so several providers (processes) on one machine never
share one; a lock dies with its holder.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import tempfile
import time
from pathlib import Path

from services.sandbox.provider import SandboxError


def pids_of_uid(uid: int) -> list[int]:
    """Host pids of processes owned by `uid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                continue
    return pids


def threads_of_uid(uid: int) -> int:
    """Threads of all processes of `uid`: what the kernel counts against its RLIMIT_NPROC."""
    total = 0
    for pid in pids_of_uid(uid):
        try:
            total += max(1, os.stat(f"/proc/{pid}/task").st_nlink - 2)
        except FileNotFoundError:
            continue
    return total


def kill_uid(uid: int, timeout_s: float = 10.0) -> int:
    """SIGKILL every process of `uid` until none is left; returns how many were killed."""
    killed = 0
    deadline = time.monotonic() + timeout_s
    while pids := pids_of_uid(uid):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise SandboxError(f"processes of sandbox uid {uid} survive SIGKILL: {pids}")
        time.sleep(0.005)
    return killed


class UidPool:
    """Leases uids in [base, base + size) across every process of this machine."""

    def __init__(self, base: int, size: int, lock_dir: Path | None = None) -> None:
        self.base, self.size = base, size
        self.lock_dir = lock_dir or Path(tempfile.gettempdir()) / "riptide-sandbox-uids"
        self.lock_dir.mkdir(mode=0o700, exist_ok=True)
        self._held: dict[int, int] = {}

    def lease(self) -> int:
        """A uid no other sandbox holds and no process runs as; raises if none is free."""
        start = random.randrange(self.size)
        for i in range(self.size):
            uid = self.base + (start + i) % self.size
            if uid in self._held:
                continue
            fd = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if pids_of_uid(uid):  # left over by a crashed provider: leave it alone
                os.close(fd)
                continue
            self._held[uid] = fd
            return uid
        raise SandboxError(f"all {self.size} sandbox uids from {self.base} are in use")

    def release(self, uid: int) -> None:
        fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)
