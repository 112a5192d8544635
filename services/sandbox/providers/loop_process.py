"""A child process whose pipes and exit are awaited on whichever event loop runs: asyncio's or
uvloop's.

It is spawned by Python's `subprocess` (vfork and exec), not by the loop: uvloop spawns with
fork(), which runs the fork handlers of gRPC's core in the child of a gRPC server, and there
about one sandboxed run in five never reached exec. Its pipes are raw descriptors this module
owns (read and written with `add_reader` / `add_writer`, closed here exactly once), and its exit
is a pidfd that becomes readable (a thread waits where the kernel has no pidfd).
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from collections.abc import Callable, Sequence

_CHUNK = 65536


class LoopProcess:
    """`argv` started with its stdout (and stderr, unless merged) piped to the caller."""

    def __init__(self, argv: Sequence[str], *, stdin: bool, merge_stderr: bool,
                 pass_fds: Sequence[int] = ()) -> None:
        self._loop = asyncio.get_running_loop()
        ours: list[int] = []  # the parent's ends
        theirs: list[int] = []  # the child's ends, closed here once it has them
        try:
            stdin_fd = self._pipe(ours, theirs, child_reads=True) if stdin else subprocess.DEVNULL
            stdout_fd = self._pipe(ours, theirs, child_reads=False)
            stderr_fd = subprocess.STDOUT if merge_stderr else self._pipe(ours, theirs, False)
            self._proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=stdout_fd,
                                          stderr=stderr_fd, pass_fds=tuple(pass_fds),
                                          start_new_session=True)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        names = iter(ours)
        self.stdin_fd = next(names) if stdin else -1
        self.stdout_fd = next(names)
        self.stderr_fd = -1 if merge_stderr else next(names)
        self.pid = self._proc.pid
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._watch_exit()

    @staticmethod
    def _pipe(ours: list[int], theirs: list[int], child_reads: bool) -> int:
        read_end, write_end = os.pipe()
        mine, child = (write_end, read_end) if child_reads else (read_end, write_end)
        os.set_blocking(mine, False)
        ours.append(mine)
        theirs.append(child)
        return child

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        """The exit status (negative: the signal that killed it)."""
        return await asyncio.shield(self._exited)

    async def read_all(self, fd: int, sink: Callable[[bytes], None]) -> None:
        """Everything the child writes to `fd` (one of ours) into `sink`, then close `fd`."""
        done: asyncio.Future[None] = self._loop.create_future()

        def readable() -> None:
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if chunk:
                sink(chunk)
            elif not done.done():
                done.set_result(None)

        self._loop.add_reader(fd, readable)
        try:
            await done
        finally:
            self._loop.remove_reader(fd)
            os.close(fd)

    async def write_all(self, data: bytes) -> None:
        """`data` to the child's stdin, then close it; a child that stopped reading (exited,
        closed its stdin) ends the write early, as a shell pipe would."""
        fd, view, done = self.stdin_fd, memoryview(data), self._loop.create_future()

        def writable() -> None:
            nonlocal view
            try:
                while view:
                    view = view[os.write(fd, view[:_CHUNK]):]
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    if not done.done():
                        done.set_exception(exc)
                    return
            if not done.done():
                done.set_result(None)

        self._loop.add_writer(fd, writable)
        try:
            await done
        finally:
            self._loop.remove_writer(fd)
            os.close(fd)
            self.stdin_fd = -1

    def close_stdin(self) -> None:
        if self.stdin_fd >= 0:
            os.close(self.stdin_fd)
            self.stdin_fd = -1

    def _watch_exit(self) -> None:
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd (an old kernel, not Linux): a thread
            waiter = self._loop.run_in_executor(None, self._proc.wait)
            waiter.add_done_callback(lambda f: self._set_exit(f.result()))
            return

        def exited() -> None:
            self._loop.remove_reader(pidfd)
            os.close(pidfd)
            self._set_exit(self._proc.wait())  # exited: reaps without blocking

        self._loop.add_reader(pidfd, exited)

    def _set_exit(self, code: int) -> None:
        if not self._exited.done():
            self._exited.set_result(code)
