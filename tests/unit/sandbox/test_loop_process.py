"""A child process awaited on either event loop: its output, its exit, its stdin, and no
descriptor left open after it."""

from __future__ import annotations

import hashlib
import os
import signal

import pytest

from services.common.event_loop import run as run_on_loop
from services.sandbox.providers.loop_process import LoopProcess

LOOPS = ["asyncio", "uvloop"]


async def _run(argv: list[str], stdin: bytes | None = None,
               merge_stderr: bool = False) -> tuple[int, bytes, bytes]:
    proc = LoopProcess(argv, stdin=stdin is not None, merge_stderr=merge_stderr)
    out, err = bytearray(), bytearray()
    readers = [proc.read_all(proc.stdout_fd, out.extend)]
    if not merge_stderr:
        readers.append(proc.read_all(proc.stderr_fd, err.extend))
    if stdin is not None:
        await proc.write_all(stdin)
    for reader in readers:
        await reader
    return await proc.wait(), bytes(out), bytes(err)


@pytest.mark.parametrize("loop", LOOPS)
def test_output_streams_and_exit_status(loop: str) -> None:
    code, out, err = run_on_loop(_run(["bash", "-c", "echo out; echo err >&2; exit 7"]), loop)
    assert (code, out, err) == (7, b"out\n", b"err\n")
    code, out, _ = run_on_loop(_run(["bash", "-c", "echo out; echo err >&2"],
                                    merge_stderr=True), loop)
    assert (code, sorted(out.splitlines())) == (0, [b"err", b"out"])


@pytest.mark.parametrize("loop", LOOPS)
def test_stdin_larger_than_a_pipe_arrives_whole(loop: str) -> None:
    data = os.urandom(3 << 20)
    code, out, _ = run_on_loop(_run(["sha256sum"], stdin=data), loop)
    assert code == 0 and out.split()[0].decode() == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_child_that_stops_reading_ends_the_write_quietly(loop: str) -> None:
    code, out, _ = run_on_loop(_run(["head", "-c", "5"], stdin=b"x" * (4 << 20)), loop)
    assert (code, out) == (0, b"xxxxx")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_killed_child_reports_its_signal(loop: str) -> None:
    async def killed() -> int:
        proc = LoopProcess(["sleep", "30"], stdin=False, merge_stderr=True)
        os.kill(proc.pid, signal.SIGKILL)
        await proc.read_all(proc.stdout_fd, lambda _: None)
        return await proc.wait()

    assert run_on_loop(killed(), loop) == -signal.SIGKILL


@pytest.mark.parametrize("loop", LOOPS)
def test_no_descriptor_is_left_open(loop: str) -> None:
    before = len(os.listdir("/proc/self/fd"))

    async def many() -> None:
        for _ in range(40):
            await _run(["bash", "-c", "cat >/dev/null; echo done"], stdin=b"abc")

    run_on_loop(many(), loop)
    assert len(os.listdir("/proc/self/fd")) <= before + 2  # the loop's own (epoll, self-pipe)
