"""mini-swe-agent's environment over a real local sandbox: commands run there (not on this
host), from the agent's thread, with the local environment's results, timeouts and submission."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR",
                      str(Path(tempfile.gettempdir()) / "riptide-mini-swe-agent"))
pytest.importorskip("minisweagent", reason="the mini-swe-agent extra is not installed "
                    "(pip install 'riptide[mini-swe-agent]')")

from minisweagent.exceptions import Submitted  # noqa: E402

from services.sandbox.harnesses.mini_swe_environment import (  # noqa: E402
    EpisodeOver,
    SandboxMiniEnvironment,
)


async def _in_thread(env: SandboxMiniEnvironment, command: str, **kwargs: Any) -> dict[str, Any]:
    """Call `execute` as the agent does: synchronously, from a worker thread."""
    return await asyncio.to_thread(env.execute, {"command": command}, **kwargs)


def test_commands_run_in_the_sandbox_from_the_agent_thread(sandbox: Callable[[], Any]) -> None:
    async def go() -> None:
        async with sandbox() as terminal:
            env = SandboxMiniEnvironment(terminal, asyncio.get_running_loop(),
                                         time.monotonic() + 60, env={"PAGER": "cat"})
            out = await _in_thread(env, "pwd; echo $PAGER; hostname; "
                                   "echo from-agent > /app/made.txt; exit 3")
            assert out == {"output": "/app\ncat\nsandbox\n", "returncode": 3,
                           "exception_info": ""}
            # The file is in the sandbox's tree, not on this host.
            assert not Path("/app/made.txt").exists()
            seen = await terminal.exec("cat /app/made.txt", timeout_s=10)
            assert seen.stdout == "from-agent\n"
            out = await _in_thread(env, "pwd", cwd="/tmp")
            assert out["output"] == "/tmp\n" and out["returncode"] == 0
            assert terminal.ran("echo from-agent")

    asyncio.run(go())


def test_timeout_reads_as_the_local_environment_reports_it(sandbox: Callable[[], Any]) -> None:
    async def go() -> None:
        async with sandbox() as terminal:
            env = SandboxMiniEnvironment(terminal, asyncio.get_running_loop(),
                                         time.monotonic() + 60, timeout=1)
            started = time.monotonic()
            out = await _in_thread(env, "echo before; sleep 30")
            assert time.monotonic() - started < 15
            assert out["returncode"] == -1 and "before" in out["output"]
            assert "timed out after 1 seconds" in out["exception_info"]
            assert out["extra"]["exception_type"] == "TimeoutExpired"

    asyncio.run(go())


def test_submission_ends_the_run_with_its_output(sandbox: Callable[[], Any]) -> None:
    async def go() -> None:
        async with sandbox() as terminal:
            env = SandboxMiniEnvironment(terminal, asyncio.get_running_loop(),
                                         time.monotonic() + 60)
            with pytest.raises(Submitted) as caught:
                await _in_thread(env, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo patch")
            assert caught.value.messages[0]["extra"] == {"exit_status": "Submitted",
                                                         "submission": "patch\n"}
            # Printed by a failing command it is no submission (as in mini-swe-agent).
            out = await _in_thread(env, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; false")
            assert out["returncode"] == 1

    asyncio.run(go())


def test_templates_describe_the_sandbox_and_the_episode_end_stops_commands(
        sandbox: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RIPTIDE_HOST_ONLY", "1")

    async def go() -> None:
        async with sandbox() as terminal:
            env = SandboxMiniEnvironment(terminal, asyncio.get_running_loop(),
                                         time.monotonic() + 60, env={"PAGER": "cat"})
            await env.describe_sandbox()
            variables = env.get_template_vars()
            assert variables["system"] == "Linux" and variables["node"] == "sandbox"
            assert variables["machine"] and variables["PAGER"] == "cat"
            assert "RIPTIDE_HOST_ONLY" not in variables  # this host's environment is not told
            env.stopped.set()
            ran = len(terminal.commands)
            with pytest.raises(EpisodeOver):
                await _in_thread(env, "echo too late")
            assert len(terminal.commands) == ran

    asyncio.run(go())
