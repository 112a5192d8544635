"""A sandbox provider that runs nothing: it records commands and answers with set output.

For unit tests of the agent and its protocols, where a real sandbox adds nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path

from services.sandbox.provider import ExecResult, SandboxHandle, SandboxProvider

HANDLE = SandboxHandle("sbx-test", "task", "fake")


class FakeProvider(SandboxProvider):
    """Answers each command with `output_for(command)` (default: `output`); records what ran
    as (command, timeout_s)."""

    name = "fake"

    def __init__(self, output: str = "ok", delay_s: float = 0.0,
                 output_for: Callable[[str], str] | None = None) -> None:
        self.commands: list[tuple[str, float]] = []
        self.output_for = output_for or (lambda command: output)
        self.delay_s = delay_s

    async def create(self, task: object, labels: Mapping[str, str] | None = None
                     ) -> SandboxHandle:
        return HANDLE

    async def exec(self, handle: SandboxHandle, command: str, timeout_s: float,
                   cwd: str | None = None, env: Mapping[str, str] | None = None) -> ExecResult:
        self.commands.append((command, timeout_s))
        await asyncio.sleep(self.delay_s)
        return ExecResult(0, self.output_for(command))

    async def upload(self, handle: SandboxHandle, local_path: Path | str, remote: str) -> None:
        raise NotImplementedError

    async def download(self, handle: SandboxHandle, remote: str, local: Path | str) -> None:
        raise NotImplementedError

    async def delete(self, handle: SandboxHandle) -> None:
        return None
