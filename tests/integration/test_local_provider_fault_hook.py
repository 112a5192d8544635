"""The local provider's fault hook (`fail_create_while`, used by the fault suite and
bench/soak.py): while its flag file exists every creation fails with a SandboxError and
leaves nothing behind; once it is gone creation works again; without it nothing changes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.sandbox.provider import SandboxError
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import Task

REPO = Path(__file__).resolve().parents[2]


def test_creation_fails_while_the_flag_exists(tmp_path: Path) -> None:
    flag = tmp_path / "fail-create"
    provider = LocalProvider(LocalProviderConfig(fail_create_while=flag))
    task = Task.load(REPO / "tasks" / "config-edit")

    async def go() -> None:
        try:
            flag.touch()
            with pytest.raises(SandboxError, match="injected fault"):
                await provider.create(task)
            assert provider.stats()["sandboxes_alive"] == 0
            flag.unlink()
            handle = await provider.create(task)
            result = await provider.exec(handle, "echo ok", timeout_s=10)
            assert result.exit_code == 0 and result.stdout == "ok\n"
            await provider.delete(handle)
        finally:
            await provider.close()

    asyncio.run(go())
