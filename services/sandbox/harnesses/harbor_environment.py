"""A Harbor environment whose container is the episode's Riptide sandbox.

Harbor's agents (Terminus-2) act on a `BaseEnvironment`: exec, upload, download. This one
forwards all of them to the episode's `SandboxTerminal`, so they run in Riptide's own sandbox
(local or Daytona) and are recorded like the built-in agents' commands. Starting and stopping
it creates and deletes nothing: the sandbox service owns the sandbox's life.

One thing a container has that a sandbox exec does not: processes that outlive the command
that started them. Terminus-2 starts a tmux server with `tmux new-session -d` in one exec and
drives it with `send-keys` in the next; on the local provider every exec is its own process
tree, torn down when it returns. So `start` runs a tmux server in the foreground (`tmux -D`)
as one long exec that lasts until `stop`; Harbor's own tmux commands then find that server at
its usual socket and create their session in it, unchanged. Imported only with the
`terminus2` extra installed (Harbor 0.25, Python >= 3.12).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import time
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import EnvironmentPaths, TrialPaths

from services.sandbox.harness import SandboxTerminal
from services.sandbox.task import Task

log = logging.getLogger(__name__)
#: What a command killed at its timeout returns (as coreutils' `timeout` does).
TIMED_OUT_EXIT_CODE = 124
_TMUX_KEEPER = ("until command -v tmux >/dev/null 2>&1; do sleep 0.2; done; "
                "exec tmux -D")
_TMUX_READY = ('command -v tmux >/dev/null 2>&1 || exit 0; '
               'test -S "${TMUX_TMPDIR:-/tmp}/tmux-$(id -u)/default"')


class SandboxEnvironment(BaseEnvironment):
    """Harbor's view of one episode's sandbox; `deadline` (monotonic) bounds every command."""

    def __init__(self, terminal: SandboxTerminal, task: Task, trial_dir: Path,
                 deadline: float, session_id: str) -> None:
        self.terminal = terminal
        self.deadline = deadline
        self._tmux_keeper: asyncio.Task[Any] | None = None
        trial_paths = TrialPaths(trial_dir)
        trial_paths.mkdir()
        env = task.config.environment
        super().__init__(
            environment_dir=task.environment_dir, environment_name=task.name,
            session_id=session_id, trial_paths=trial_paths,
            task_env_config=EnvironmentConfig(cpus=env.cpus, memory_mb=env.memory_mb,
                                              storage_mb=env.storage_mb,
                                              workdir=terminal.workdir),
        )

    @staticmethod
    def type() -> str:
        return "riptide"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        """The sandbox already exists: there is no definition to check."""

    def _timeout_s(self, timeout_sec: float | None) -> float:
        remaining = max(1.0, self.deadline - time.monotonic())
        return min(float(timeout_sec), remaining) if timeout_sec else remaining

    async def start(self, force_build: bool) -> None:
        agent_dir = shlex.quote(str(EnvironmentPaths.agent_dir))  # Terminus-2's pane log
        made = await self.terminal.exec(f"mkdir -p {agent_dir}", timeout_s=self._timeout_s(30))
        if made.exit_code != 0:
            raise RuntimeError(f"could not create {agent_dir} in the sandbox: {made.output}")
        self._tmux_keeper = asyncio.ensure_future(
            self.terminal.exec(_TMUX_KEEPER, timeout_s=self._timeout_s(None)))
        for _ in range(100):  # the server's socket appears within ~0.1 s
            if (await self.terminal.exec(_TMUX_READY, timeout_s=10)).exit_code == 0:
                return
            if self._tmux_keeper.done():
                break
            await asyncio.sleep(0.05)
        log.warning("no tmux server came up in the sandbox; Terminus-2 starts its own")

    async def stop(self, delete: bool) -> None:
        """End the tmux server (and what runs in it); the sandbox itself stays."""
        keeper, self._tmux_keeper = self._tmux_keeper, None
        if keeper is None:
            return
        if not keeper.done():
            with contextlib.suppress(Exception):
                await self.terminal.exec("tmux kill-server", timeout_s=10)
        try:
            await asyncio.wait_for(keeper, 10)
        except (TimeoutError, Exception) as exc:  # noqa: BLE001 - its end is all we wait for
            log.debug("tmux keeper ended with %r", exc)
            keeper.cancel()

    async def exec(self, command: str, cwd: str | None = None,
                   env: dict[str, str] | None = None, timeout_sec: int | None = None,
                   user: str | int | None = None) -> ExecResult:
        # `user` is not honored: a Riptide sandbox runs every command as its one user (root).
        result = await self.terminal.exec(command, timeout_s=self._timeout_s(timeout_sec),
                                          cwd=cwd, env=self._merge_env(env))
        code = TIMED_OUT_EXIT_CODE if result.exit_code is None else result.exit_code
        return ExecResult(stdout=result.stdout, stderr=result.stderr or None, return_code=code)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self.terminal.upload(source_path, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self.terminal.upload(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await self.terminal.download(source_path, target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self.terminal.download(source_dir, target_dir)
