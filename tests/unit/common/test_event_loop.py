"""Services run their main coroutine on the loop their config names."""

from __future__ import annotations

import asyncio
import sys

import pytest

from services.common.errors import ConfigError
from services.common.event_loop import run


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_each_name_runs_its_own_loop() -> None:
    assert run(_loop_module(), "uvloop").startswith("uvloop")
    assert run(_loop_module(), "asyncio").startswith("asyncio")


def test_uvloop_missing_is_a_config_error_that_names_the_way_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    with pytest.raises(ConfigError, match='pip install uvloop.*event_loop = "asyncio"'):
        run(_loop_module(), "uvloop")


def test_the_proxies_default_to_uvloop_and_other_services_to_asyncio() -> None:
    from services.common.config import ServiceConfig
    from services.router.config import RouterConfig
    from services.sandbox.config import SandboxConfig

    assert RouterConfig().event_loop == "uvloop"
    assert SandboxConfig().event_loop == "uvloop"  # it serves the agent gateway
    assert ServiceConfig().event_loop == "asyncio"
    with pytest.raises(ValueError, match="event_loop"):
        RouterConfig(event_loop="trio")  # type: ignore[arg-type]


def test_the_running_loop_is_named_for_admin_state() -> None:
    from services.common.event_loop import running_loop_name

    async def name() -> str:
        return running_loop_name()

    assert (run(name(), "uvloop"), run(name(), "asyncio"), running_loop_name()) == (
        "uvloop", "asyncio", "")
