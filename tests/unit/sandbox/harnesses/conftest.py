"""A real local sandbox of a bundled task, and a terminal onto it, for the harness adapters."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.sandbox.harness import SandboxTerminal
from services.sandbox.provider import ExecResult, SandboxHandle
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import Task

TASK = Path(__file__).resolve().parents[4] / "tasks" / "config-edit"


class RecordingTerminal(SandboxTerminal):
    """A terminal that also keeps what ran, as the sandbox service's dashboard does."""

    def __init__(self, provider: LocalProvider, handle: SandboxHandle) -> None:
        self.commands: list[tuple[str, ExecResult]] = []
        super().__init__(provider, handle,
                         lambda command, result: self.commands.append((command, result)))

    def ran(self, needle: str) -> bool:
        return any(needle in command for command, _ in self.commands)


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalProvider]:
    provider = LocalProvider(LocalProviderConfig())
    yield provider
    asyncio.run(provider.close())


@pytest.fixture
def sandbox(provider: LocalProvider) -> Callable[[], Any]:
    """`async with sandbox() as terminal:` a fresh sandbox of config-edit, deleted after."""

    @contextlib.asynccontextmanager
    async def open_sandbox() -> AsyncIterator[RecordingTerminal]:
        handle = await provider.create(Task.load(TASK))
        try:
            yield RecordingTerminal(provider, handle)
        finally:
            await provider.delete(handle)

    return open_sandbox
