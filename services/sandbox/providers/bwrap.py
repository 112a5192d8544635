"""Running one program inside a bubblewrap sandbox, with resource limits and a wall timeout.

Every call is a fresh `bwrap` with new user, pid, network, ipc and uts namespaces over the
sandbox's own root directory; the host's /usr is bound read-only. When the call ends (or its
timeout kills the sandbox's pid 1), the pid namespace is torn down, so nothing it started
survives it. Called by providers/local.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.providers.loop_process import LoopProcess

_KILL_WAIT_S = 10.0


@dataclass(frozen=True)
class Limits:
    """Resource caps of one sandbox, applied with setrlimit (prlimit) and CPU affinity."""

    memory_mb: int
    """RLIMIT_AS of every process (address space)."""
    max_processes: int
    """RLIMIT_NPROC: processes and threads of the sandbox's host uid."""
    file_size_mb: int
    """RLIMIT_FSIZE: the largest file a process may write."""
    cpu_list: tuple[int, ...] | None = None
    """Host CPUs the sandbox may run on (None: all)."""
    max_open_files: int = 1024


@dataclass(frozen=True)
class RunOutcome:
    """What the sandboxed program did."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_s: float
    truncated: bool


class _HeadTail:
    """Keeps the first and last `cap // 2` bytes of a stream."""

    def __init__(self, cap: int) -> None:
        self.cap, self.head, self.tail, self.dropped = cap, bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.cap // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        excess = len(self.tail) - (self.cap - self.cap // 2)
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def value(self) -> bytes:
        if not self.dropped:
            return bytes(self.head + self.tail)
        marker = f"\n[... {self.dropped} bytes of output omitted ...]\n".encode()
        return bytes(self.head) + marker + bytes(self.tail)


def bwrap_argv(
    bwrap: str,
    root: Path,
    ro_binds: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    argv: Sequence[str],
) -> Callable[[int], list[str]]:
    """The bwrap command line (given bwrap's status fd) running `argv` with `root` as the
    sandbox's writable `/`."""
    head = [
        bwrap, "--unshare-user", "--uid", "0", "--gid", "0",
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "sandbox", "--die-with-parent", "--new-session", "--as-pid-1",
    ]
    args = ["--bind", str(root), "/"]
    for path in ro_binds:
        args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(64 << 20), "--tmpfs", "/dev/shm"]
    args += ["--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    args += ["--chdir", cwd, "--", *argv]
    return lambda status_fd: [*head, "--json-status-fd", str(status_fd), *args]


def limit_argv(limits: Limits, cpu_time_s: float) -> list[str]:
    """The prlimit/taskset prefix that applies `limits` before bwrap starts."""
    prefix: list[str] = []
    if limits.cpu_list:
        prefix += ["taskset", "-c", ",".join(map(str, limits.cpu_list))]
    prefix += [
        "prlimit",
        f"--as={limits.memory_mb << 20}",
        f"--nproc={limits.max_processes}",
        f"--fsize={limits.file_size_mb << 20}",
        f"--cpu={max(1, math.ceil(cpu_time_s))}",
        f"--nofile={limits.max_open_files}",
        "--core=0",
        "--",
    ]
    return prefix


def _read_status(fd: int) -> dict[str, int]:
    """Parse what bwrap wrote to its --json-status-fd so far (child-pid, exit-code)."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    status: dict[str, int] = {}
    for line in data.decode(errors="replace").splitlines():
        if line.strip():
            status.update(json.loads(line))
    return status


class SandboxRun:
    """One sandboxed process: start, wait with a timeout, kill its whole pid namespace."""

    def __init__(
        self, argv: Callable[[int], list[str]], uid: int | None, max_output_bytes: int,
        enter: Sequence[str] = (),
    ) -> None:
        self._argv, self._uid, self._cap = argv, uid, max_output_bytes
        self._enter = list(enter)  # runs first, as the provider: e.g. joining a cgroup
        self._proc: LoopProcess | None = None
        self._status_r = -1
        self._status: dict[str, int] = {}

    async def run(
        self, timeout_s: float, stdin: bytes | None = None, merge_stderr: bool = True
    ) -> RunOutcome:
        """Run to completion or to `timeout_s`; either way nothing of it is left running."""
        start = time.monotonic()
        self._status_r, status_w = os.pipe()
        os.set_blocking(self._status_r, False)
        try:
            argv = self._argv(status_w)
            if self._uid:
                # setpriv drops to the sandbox's uid instead of Popen(user=...): that keeps
                # Popen on vfork, which is ~10x cheaper than fork for a large process and does
                # not run gRPC's fork handlers in the child (they break it in a gRPC server).
                argv = ["setpriv", f"--reuid={self._uid}", f"--regid={self._uid}",
                        "--clear-groups", *argv]
            argv = [*self._enter, *argv]
            self._proc = proc = LoopProcess(argv, stdin=stdin is not None,
                                            merge_stderr=merge_stderr, pass_fds=(status_w,))
        except BaseException:
            os.close(self._status_r)
            raise
        finally:
            os.close(status_w)
        out, err = _HeadTail(self._cap), _HeadTail(self._cap)
        readers = [asyncio.create_task(proc.read_all(proc.stdout_fd, out.add))]
        if not merge_stderr:
            readers.append(asyncio.create_task(proc.read_all(proc.stderr_fd, err.add)))
        timed_out = False
        try:
            await asyncio.wait_for(self._feed_and_wait(stdin), timeout_s)
        except TimeoutError:
            timed_out = True
            await self.kill()
        except BaseException:
            await self.kill()
            raise
        finally:
            proc.close_stdin()  # where the write never began
            await asyncio.gather(*readers, return_exceptions=True)
            self._status.update(_read_status(self._status_r))
            os.close(self._status_r)
        exit_code = None if timed_out else self._status.get("exit-code")
        if not timed_out and exit_code is None:
            exit_code = -1  # bwrap itself failed before starting the program
        return RunOutcome(
            exit_code=exit_code, stdout=out.value(), stderr=err.value(), timed_out=timed_out,
            duration_s=time.monotonic() - start, truncated=bool(out.dropped or err.dropped),
        )

    @property
    def started(self) -> bool:
        """Whether bwrap reached the program (False: bwrap failed to set up the sandbox)."""
        return "exit-code" in self._status or "child-pid" in self._status

    async def _feed_and_wait(self, stdin: bytes | None) -> None:
        assert self._proc is not None
        if stdin is not None:
            await self._proc.write_all(stdin)
        await self._proc.wait()

    async def kill(self) -> None:
        """SIGKILL the sandbox's pid 1 (the kernel then kills its whole pid namespace) and
        wait until bwrap has reaped it, i.e. until every process of the run is gone."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        if self._status_r >= 0:
            try:
                self._status.update(_read_status(self._status_r))
            except OSError:
                pass
        child = self._status.get("child-pid")
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            _killpg(proc.pid)
        try:
            await asyncio.wait_for(proc.wait(), _KILL_WAIT_S)
        except TimeoutError:
            _killpg(proc.pid)
            await proc.wait()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
