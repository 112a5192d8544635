"""The contract every sandbox provider must pass: local, and Daytona through the real SDK
against the stand-in (both its plain-exec and its session-command paths)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.sandbox.config import DaytonaProviderConfig
from services.sandbox.provider import SandboxError, SandboxProvider
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import TaskSet
from services.testing.daytona_server import DaytonaServer

REPO = Path(__file__).resolve().parents[2]
TASK = TaskSet.load(REPO / "tasks").get("csv-revenue")
KINDS = ["local", "daytona-exec", "daytona-session"]


@pytest.fixture(scope="module")
def daytona() -> Iterator[DaytonaServer]:
    with DaytonaServer(REPO / "tasks") as server:
        yield server


def _make(kind: str, daytona: DaytonaServer, monkeypatch: pytest.MonkeyPatch) -> SandboxProvider:
    if kind == "local":
        return LocalProvider(LocalProviderConfig())
    from services.sandbox.providers.daytona import DaytonaProvider

    monkeypatch.setenv("DAYTONA_API_KEY", daytona.api_key)
    session_min_s = 0.0 if kind == "daytona-session" else 600.0
    return DaytonaProvider(DaytonaProviderConfig(
        api_url=daytona.api_url, image_template="riptide-tasks/{task}:latest",
        session_command_min_timeout_s=session_min_s, session_poll_interval_s=0.1))


async def _with_sandbox(provider: SandboxProvider) -> AsyncIterator[object]:
    handle = await provider.create(TASK, labels={"riptide.episode": "contract"})
    try:
        yield handle
    finally:
        await provider.delete(handle)
        await provider.close()


@pytest.mark.parametrize("kind", KINDS)
def test_provider_contract(kind: str, daytona: DaytonaServer, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    provider = _make(kind, daytona, monkeypatch)
    upload = tmp_path / "up"
    (upload / "sub").mkdir(parents=True)
    (upload / "a.txt").write_text("alpha\n")
    (upload / "sub" / "run.sh").write_text("#!/bin/bash\necho ran\n")
    (upload / "sub" / "run.sh").chmod(0o755)

    async def run() -> None:
        async for handle in _with_sandbox(provider):
            result = await provider.exec(handle, "pwd; echo $GREETING; exit 3", 10,
                                         env={"GREETING": "hi"})
            assert (result.exit_code, result.output) == (3, f"{TASK.workdir}\nhi\n")
            assert (await provider.exec(handle, "pwd", 10, cwd="/tmp")).output == "/tmp\n"
            withheld = await provider.exec(handle, "ls /tests /solution", 10)
            assert withheld.exit_code != 0, "tests and solution are withheld from the agent"

            started = time.monotonic()
            slow = await provider.exec(handle, "(sleep 2; touch /tmp/late) & sleep 30", 1)
            assert slow.timed_out and slow.exit_code is None
            assert time.monotonic() - started < 10
            await asyncio.sleep(2.5)
            after = await provider.exec(handle, "ls /tmp/late || echo none", 10)
            assert after.stdout.strip().endswith("none"), "a timed-out command is killed whole"

            await provider.upload(handle, upload, "/data/in")
            await provider.upload(handle, upload / "a.txt", "/data/single.txt")
            listing = await provider.exec(
                handle, "cat /data/in/a.txt /data/single.txt && /data/in/sub/run.sh", 10)
            assert listing.output == "alpha\nalpha\nran\n", listing.output
            await provider.exec(handle, "mkdir -p /out/d && echo beta > /out/d/b.txt", 10)
            await provider.download(handle, "/out/d/b.txt", tmp_path / "b.txt")
            await provider.download(handle, "/out/d", tmp_path / "d")
            assert (tmp_path / "b.txt").read_text() == "beta\n"
            assert (tmp_path / "d" / "b.txt").read_text() == "beta\n"
            with pytest.raises(FileNotFoundError):
                await provider.download(handle, "/no/such/file", tmp_path / "x")
        with pytest.raises(SandboxError):
            await provider.exec(handle, "true", 5)
        await provider.delete(handle)  # idempotent

    asyncio.run(run())
    if kind != "local":
        assert daytona.state()["sandboxes"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_one_episode_shares_one_shell(kind: str, daytona: DaytonaServer,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An episode's commands run in one shell (services/sandbox/shell_session.py) on every
    provider: cwd, variables, functions and aliases carry over; exit codes are the command's."""
    from services.sandbox.shell_session import ShellSession

    provider = _make(kind, daytona, monkeypatch)

    async def run() -> None:
        async for handle in _with_sandbox(provider):
            shell = ShellSession(provider, handle)  # type: ignore[arg-type]
            steps = [("mkdir -p /tmp/work && cd /tmp/work", 0, ""),
                     ("export GREETING=hi; PLAIN=1; greet() { echo \"$GREETING $1\"; }; "
                      "alias say=echo; false", 1, ""),
                     ("pwd; echo $PLAIN; greet you; say aliased", 0,
                      "/tmp/work\n1\nhi you\naliased\n"),
                     ("cd /; exit 7", 7, ""), ("cd /tmp; sleep 30", None, None),
                     ("pwd; bash -c 'echo $GREETING'", 0, "/\nhi\n")]
            for command, code, output in steps:
                result = await shell.run(command, 2)
                assert result.exit_code == code, (command, result)
                # Partial output of a killed command is provider-specific (Daytona has none).
                assert output is None or result.output == output, (command, result)
            fresh = await provider.exec(handle, "pwd; echo ${GREETING:-unset}", 10)
            assert fresh.output == f"{TASK.workdir}\nunset\n", "plain exec stays stateless"

    asyncio.run(run())
