"""Harbor's environment over a real local sandbox: exec and file moves reach the sandbox, and
Harbor's own tmux session (Terminus-2's terminal) lives across execs, which on the local
provider are each their own process tree."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if sys.version_info < (3, 12):
    pytest.skip("Harbor 0.25 (the terminus2 extra) requires Python >= 3.12",
                allow_module_level=True)
pytest.importorskip("harbor", reason="the terminus2 extra is not installed "
                    "(pip install 'riptide[terminus2]')")

from harbor.agents.terminus_2.tmux_session import TmuxSession  # noqa: E402

from services.sandbox.harnesses.harbor_environment import (  # noqa: E402
    TIMED_OUT_EXIT_CODE,
    SandboxEnvironment,
)
from services.sandbox.task import Task  # noqa: E402

from .conftest import TASK  # noqa: E402


def _environment(terminal: Any, tmp_path: Path, seconds: float = 60) -> SandboxEnvironment:
    return SandboxEnvironment(terminal, Task.load(TASK), tmp_path / "trial",
                              time.monotonic() + seconds, session_id="ep-test")


def test_exec_and_files_reach_the_sandbox(sandbox: Callable[[], Any], tmp_path: Path) -> None:
    local = tmp_path / "up"
    (local / "sub").mkdir(parents=True)
    (local / "sub" / "a.txt").write_text("alpha\n")
    single = tmp_path / "one.txt"
    single.write_text("one\n")

    async def go() -> None:
        async with sandbox() as terminal:
            env = _environment(terminal, tmp_path)
            result = await env.exec("pwd; echo $GREETING; exit 4", env={"GREETING": "hi"})
            assert (result.return_code, result.stdout) == (4, "/app\nhi\n")
            assert (await env.exec("pwd", cwd="/tmp")).stdout == "/tmp\n"
            late = await env.exec("echo start; sleep 30", timeout_sec=1)
            assert late.return_code == TIMED_OUT_EXIT_CODE and "start" in (late.stdout or "")

            await env.upload_dir(local, "/data/in")
            await env.upload_file(single, "/data/one.txt")
            listed = await env.exec("cat /data/in/sub/a.txt /data/one.txt")
            assert listed.stdout == "alpha\none\n"
            assert not Path("/data/in").exists()  # the sandbox's /data, not this host's
            await env.download_file("/app/app.conf", tmp_path / "app.conf")
            assert "port" in (tmp_path / "app.conf").read_text()
            await env.download_dir("/data/in", tmp_path / "back")
            assert (tmp_path / "back" / "sub" / "a.txt").read_text() == "alpha\n"
            assert await env.is_dir("/data/in") and await env.is_file("/data/one.txt")
            assert terminal.ran("echo $GREETING")

    asyncio.run(go())


def test_harbor_tmux_session_lives_across_execs(sandbox: Callable[[], Any],
                                                tmp_path: Path) -> None:
    async def go() -> None:
        async with sandbox() as terminal:
            env = _environment(terminal, tmp_path)
            await env.start(force_build=False)
            session = TmuxSession("terminus-2", env, Path("/logs/agent/terminus_2.pane"),
                                  None, None)
            await session.start()
            await session.send_keys(["cd /tmp && export MARK=kept", "Enter"],
                                    min_timeout_sec=0.3)
            await session.send_keys(["echo $MARK-$(pwd) > /app/mark.txt", "Enter"],
                                    min_timeout_sec=0.3)
            assert await session.is_session_alive()
            screen = await session.get_incremental_output()
            assert "echo $MARK-$(pwd)" in screen
            mark = await env.exec("cat /app/mark.txt")
            assert mark.stdout == "kept-/tmp\n"  # one shell kept its state between turns
            await env.stop(delete=False)
            assert not await session.is_session_alive()
            assert (await env.exec("echo still-here")).stdout == "still-here\n"

    asyncio.run(go())
