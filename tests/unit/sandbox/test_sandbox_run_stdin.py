"""A sandboxed run whose program exits without reading its stdin ends normally on both event
loops: asyncio reports the closed pipe as BrokenPipeError, uvloop as a RuntimeError ("the
handler is closed"), which used to fail about one run in five there."""

from __future__ import annotations

import pytest

from services.common.event_loop import run as run_on_loop
from services.sandbox.providers.bwrap import SandboxRun

RUNS = 60


def _exits_at_once(status_fd: int) -> list[str]:
    # What bwrap reports on its status fd, then an exit that never reads stdin.
    return ["bash", "-c", f"echo '{{\"exit-code\": 0}}' >&{status_fd}; exit 0"]


async def _runs() -> list[int | None]:
    outcomes = []
    for _ in range(RUNS):
        run = SandboxRun(_exits_at_once, None, 1 << 16)
        outcomes.append((await run.run(10, stdin=b"x" * (1 << 20))).exit_code)
    return outcomes


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_a_program_that_ignores_its_stdin_exits_cleanly(event_loop: str) -> None:
    assert run_on_loop(_runs(), event_loop) == [0] * RUNS

