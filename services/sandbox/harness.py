"""Black-box agent harnesses: third-party agents that reach the model through the gateway.

A harness (Harbor's Terminus-2, mini-swe-agent) is given, per episode, an OpenAI-compatible
base URL and a key that dies with the episode (services/sandbox/gateway/), and a terminal
onto the episode's sandbox. Whatever it sends the model is tokenized and matched on our side,
so it needs no changes. Its commands run through `SandboxTerminal`, which also records them
for the dashboard. A harness that fails raises `HarnessError`; running out of time is the
caller's to detect (both become a missing verdict with their cause, never a reward of 0).

Chosen by `sandbox.agent.harness`; `make_harness` is the one factory. Called by the harness
agent (harness_agent.py).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.errors import ConfigError, Unavailable
from services.sandbox.failures import AgentTimeout
from services.sandbox.provider import ExecResult, SandboxHandle, SandboxProvider

if TYPE_CHECKING:
    from services.sandbox.task import Task

#: What a command did, for the per-sample view: (command, its result).
CommandFn = Callable[[str, ExecResult], None]


class HarnessError(Unavailable):
    """The harness crashed or could not run: the episode has no verdict (agent/harness error)."""


class HarnessTimeout(AgentTimeout):
    """The harness did not return within the episode's wall time: no verdict (agent timeout)."""


class SandboxTerminal:
    """The episode's sandbox as a harness sees it: run commands, move files."""

    def __init__(self, provider: SandboxProvider, handle: SandboxHandle,
                 on_command: CommandFn | None = None) -> None:
        self.provider = provider
        self.handle = handle
        self._on_command = on_command or (lambda command, result: None)

    @property
    def workdir(self) -> str:
        return self.handle.workdir

    async def exec(self, command: str, timeout_s: float, cwd: str | None = None,
                   env: Mapping[str, str] | None = None) -> ExecResult:
        """Run `command` with `bash -lc` in the sandbox, killed at `timeout_s`."""
        result = await self.provider.exec(self.handle, command, timeout_s, cwd=cwd, env=env)
        self._on_command(command, result)
        return result

    async def upload(self, local_path: Path | str, remote_path: str) -> None:
        await self.provider.upload(self.handle, local_path, remote_path)

    async def download(self, remote_path: str, local_path: Path | str) -> None:
        await self.provider.download(self.handle, remote_path, local_path)


@dataclass
class HarnessContext:
    """Everything a harness gets for one episode."""

    episode_id: str
    base_url: str
    """The episode's OpenAI-compatible base URL, ending in `/v1`."""
    api_key: str
    model: str
    """The model name to send (what the gateway's `/v1/models` lists)."""
    instruction: str
    task: Task
    terminal: SandboxTerminal
    max_turns: int
    deadline: float
    """`time.monotonic()` by which the harness must have returned."""
    work_dir: Path
    """A host folder of this episode for the harness's own files (logs, trajectories)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


@dataclass
class HarnessOutcome:
    """How the harness ended, in the agent's terms (complete, max_turns, ...)."""

    finish_reason: str
    detail: str = ""


class Harness(abc.ABC):
    """A third-party agent run unchanged against the gateway and a sandbox terminal."""

    name: str = "abstract"

    @abc.abstractmethod
    async def run(self, context: HarnessContext) -> HarnessOutcome:
        """Run the whole episode; raise HarnessError when the harness itself fails."""


def make_harness(name: str) -> Harness:
    """The harness named by `sandbox.agent.harness` (not `builtin`, which is TerminalAgent)."""
    if name == "terminus2":
        from services.sandbox.harnesses.terminus2 import Terminus2Harness

        return Terminus2Harness()
    if name == "mini_swe_agent":
        from services.sandbox.harnesses.mini_swe_agent import MiniSweAgentHarness

        return MiniSweAgentHarness()
    raise ConfigError(f"unknown harness {name!r}; use 'builtin', 'terminus2' or 'mini_swe_agent'")
