"""Local sandboxes: the task's files land where its Dockerfile puts them; upload and download
move files and directories without ever following a sandbox-made link onto the host."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.sandbox.provider import SandboxError
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import Task, TaskSet

REPO = Path(__file__).resolve().parents[2]
TB2 = REPO.parent / "shared" / "reference" / "tb2"


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalProvider]:
    provider = LocalProvider(LocalProviderConfig())
    yield provider
    asyncio.run(provider.close())


@pytest.mark.skipif(not TB2.is_dir(), reason="reference terminal-bench-2 tasks not present")
def test_reference_tasks_get_their_copied_files(provider: LocalProvider) -> None:
    expected = {
        "fix-git": ("/app/personal-site", "ls /app/setup.sh /app/resources/patch_files/about.md"),
        "largest-eigenval": ("/app", "ls /app/eigen.py /app/eval.py"),
        "regex-log": ("/app", "test -d /app"),
    }

    async def go() -> None:
        tasks = TaskSet.load(TB2)
        for name, (workdir, check) in expected.items():
            handle = await provider.create(tasks.get(name))
            try:
                r = await provider.exec(handle, f"pwd; {check}", timeout_s=10)
                assert r.exit_code == 0 and r.stdout.startswith(workdir + "\n"), r.output
            finally:
                await provider.delete(handle)

    asyncio.run(go())


def test_upload_download_roundtrip(provider: LocalProvider, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha\n")
    (src / "sub" / "b.sh").write_text("echo beta\n")
    (src / "sub" / "b.sh").chmod(0o755)
    single = tmp_path / "one.txt"
    single.write_text("single\n")
    task = Task.load(REPO / "tasks" / "config-edit")

    async def go() -> None:
        handle = await provider.create(task)
        try:
            await provider.upload(handle, src, "/tests")
            await provider.upload(handle, single, "/logs/verifier/renamed.txt")
            r = await provider.exec(handle, "cat /tests/a.txt; /tests/sub/b.sh; "
                                    "cat /logs/verifier/renamed.txt", timeout_s=10)
            assert r.stdout == "alpha\nbeta\nsingle\n", r.output
            await provider.download(handle, "/tests", tmp_path / "back")
            assert (tmp_path / "back" / "sub" / "b.sh").read_text() == "echo beta\n"
            assert (tmp_path / "back" / "sub" / "b.sh").stat().st_mode & 0o100
            await provider.download(handle, "/app/app.conf", tmp_path / "conf")
            assert (tmp_path / "conf").read_text().startswith("# Application settings")
            with pytest.raises(FileNotFoundError):
                await provider.download(handle, "/logs/verifier/reward.txt", tmp_path / "r")
        finally:
            await provider.delete(handle)

    asyncio.run(go())


def test_download_never_follows_links_to_host(provider: LocalProvider, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-ONLY\n")
    task = Task.load(REPO / "tasks" / "config-edit")

    async def go() -> None:
        handle = await provider.create(task)
        try:
            await provider.exec(handle, f"ln -s {secret} /app/link; mkdir -p /app/d; "
                                f"ln -s {tmp_path} /app/d/dirlink", timeout_s=10)
            for remote in ("/app/link", "/app/d"):
                try:
                    await provider.download(handle, remote, tmp_path / "out")
                except SandboxError as exc:  # refusing the link is fine; following it is not
                    assert "refused" in str(exc)
                    continue
                out = tmp_path / "out"
                texts = [p.read_text() for p in out.rglob("*") if p.is_file()] if out.is_dir() \
                    else ([out.read_text()] if out.is_file() and not out.is_symlink() else [])
                assert all("HOST-ONLY" not in t for t in texts)
        finally:
            await provider.delete(handle)

    asyncio.run(go())


def test_copy_into_system_dir_is_refused(provider: LocalProvider, tmp_path: Path) -> None:
    task_dir = tmp_path / "bad"
    (task_dir / "environment").mkdir(parents=True)
    (task_dir / "tests").mkdir()
    (task_dir / "task.toml").write_text('version = "1.0"\n')
    (task_dir / "instruction.md").write_text("x\n")
    (task_dir / "tests" / "test.sh").write_text("true\n")
    (task_dir / "environment" / "tool").write_text("#!/bin/sh\n")
    (task_dir / "environment" / "Dockerfile").write_text("FROM x\nCOPY tool /usr/local/bin/\n")
    with pytest.raises(SandboxError, match=r"line 2: copies into /usr/local/bin"):
        asyncio.run(provider.create(Task.load(task_dir)))
