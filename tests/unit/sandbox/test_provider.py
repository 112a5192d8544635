"""The provider factory and the result type every provider returns."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.common.errors import ConfigError
from services.sandbox.provider import ExecResult, make_provider
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig


def test_factory_picks_by_type() -> None:
    provider = make_provider(LocalProviderConfig())
    try:
        assert isinstance(provider, LocalProvider) and provider.stats()["sandboxes_alive"] == 0
    finally:
        asyncio.run(provider.close())
    with pytest.raises(ConfigError, match="unknown sandbox provider type 'docker'"):
        make_provider(SimpleNamespace(type="docker"))


def test_local_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="max_proceses"):
        LocalProviderConfig.model_validate({"type": "local", "max_proceses": 3})


def test_output_joins_streams() -> None:
    assert ExecResult(0, "out\n", "err\n").output == "out\nerr\n"
    assert ExecResult(None, "x", timed_out=True).output == "x"
