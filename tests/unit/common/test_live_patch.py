"""Live config patches are strict: finite numbers, no strings or booleans taken for numbers,
counts within their bounds, all-or-nothing, and errors that quote a short prefix only."""

from __future__ import annotations

import math
from typing import Any

import pytest

from services.common.errors import ConfigError
from services.common.service import ServiceRuntime
from services.rollout.config import SchedulerConfig


class _Runtime(ServiceRuntime):
    tunable_fields = frozenset({"temperature", "max_concurrent_samples", "top_p"})

    def __init__(self) -> None:
        super().__init__()
        self.tunable = SchedulerConfig()


@pytest.mark.parametrize(("patch", "says"), [
    ({"temperature": math.nan}, "finite number"),
    ({"temperature": math.inf}, "finite number"),
    ({"max_concurrent_samples": "8"}, "valid integer"),
    ({"max_concurrent_samples": True}, "valid integer"),
    ({"max_concurrent_samples": 8.0}, "valid integer"),
    ({"max_concurrent_samples": 10**9}, "less than or equal"),
    ({"temperature": "0.5"}, "valid number"),
])
def test_bad_values_are_refused_and_change_nothing(patch: dict[str, Any], says: str) -> None:
    runtime = _Runtime()
    before = runtime.tunable.model_dump()
    with pytest.raises(ConfigError, match=says):
        runtime.apply_config_patch({"top_p": 0.5, **patch})
    assert runtime.tunable.model_dump() == before


def test_good_values_apply_and_an_int_is_a_float() -> None:
    runtime = _Runtime()
    after = runtime.apply_config_patch({"temperature": 1, "max_concurrent_samples": 64})
    assert after["temperature"] == 1.0 and after["max_concurrent_samples"] == 64


def test_a_huge_unknown_key_is_quoted_short() -> None:
    with pytest.raises(ConfigError) as refused:
        _Runtime().apply_config_patch({"k" * 1_000_000: 1})
    assert "not tunable live" in str(refused.value) and len(str(refused.value)) < 300
