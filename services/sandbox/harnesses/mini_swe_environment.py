"""mini-swe-agent's environment for an episode: its commands run in the Riptide sandbox.

mini-swe-agent's agent is synchronous and calls `environment.execute(action)` for each bash
action. This environment is its `LocalEnvironment` with one change: `execute` runs the command
through the episode's `SandboxTerminal` (on the service's event loop, from the agent's thread,
with `asyncio.run_coroutine_threadsafe`) instead of a subprocess on this host. What it returns,
how a timeout reads and how `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` ends the run are the
local environment's own. Imported only with the `mini-swe-agent` extra installed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from minisweagent.environments.local import LocalEnvironment
from minisweagent.utils.serialize import recursive_merge

from services.sandbox.harness import SandboxTerminal

#: What `platform.uname()` gives the local environment's templates, read inside the sandbox.
_UNAME_FIELDS = ("system", "node", "release", "version", "machine")
_UNAME = "uname -s; uname -n; uname -r; uname -v; uname -m"


class EpisodeOver(RuntimeError):
    """The episode ended (deadline or cancellation) while the agent was still running."""


class SandboxMiniEnvironment(LocalEnvironment):
    """mini-swe-agent's local environment, executing in the episode's sandbox."""

    def __init__(self, terminal: SandboxTerminal, loop: asyncio.AbstractEventLoop,
                 deadline: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.terminal = terminal
        self.loop = loop
        self.deadline = deadline
        self.stopped = threading.Event()
        self.uname: dict[str, str] = {}

    async def describe_sandbox(self) -> None:
        """Read the sandbox's `uname` for the prompt templates (call once, on the loop)."""
        result = await self.terminal.exec(_UNAME, timeout_s=30)
        lines = result.stdout.splitlines()
        self.uname = dict(zip(_UNAME_FIELDS, lines + [""] * len(_UNAME_FIELDS), strict=False))

    def execute(self, action: dict[str, Any], cwd: str = "", *,
                timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        remaining = self.deadline - time.monotonic()
        if self.stopped.is_set() or remaining <= 0:
            raise EpisodeOver("the episode ended before this command could run")
        timeout_s = min(float(timeout or self.config.timeout), remaining)
        run = self.terminal.exec(command, timeout_s=timeout_s,
                                 cwd=cwd or self.config.cwd or None, env=self.config.env)
        result = asyncio.run_coroutine_threadsafe(run, self.loop).result()
        if result.timed_out:  # as LocalEnvironment reports subprocess.TimeoutExpired
            output = {
                "output": result.output, "returncode": -1,
                "exception_info": "An error occurred while executing the command: Command "
                                  f"'{command}' timed out after {timeout_s:g} seconds",
                "extra": {"exception_type": "TimeoutExpired",
                          "exception": f"timed out after {timeout_s:g} seconds"},
            }
        else:
            output = {"output": result.output, "returncode": result.exit_code,
                      "exception_info": ""}
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        # The local environment adds this host's uname and environment; the agent acts in the
        # sandbox, so it is told the sandbox's uname and the variables its commands get.
        return recursive_merge(self.config.model_dump(), self.uname, self.config.env, kwargs)
