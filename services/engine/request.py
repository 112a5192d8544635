"""One generation request inside the engine: its sampling parameters and its running state.

The HTTP layer parses SGLang's `GenerateReqInput` into `GenRequest`s; the scheduler advances
them and reports every change through `emit`, a thread-safe callback.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.errors import InvalidRequest

# SGLang parameters accepted only at their neutral value (the built-in engine does not implement
# them); anything else is a 400 rather than a silently different distribution.
_NEUTRAL = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
    "stop_regex": None,
}
_ACCEPTED = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "sampling_seed",
    "spaces_between_special_tokens",
    "custom_params",
}


@dataclass
class SamplingParams:
    """The sampling parameters of one request, validated."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> SamplingParams:
        raw = dict(raw or {})
        for key, neutral in _NEUTRAL.items():
            value = raw.pop(key, neutral)
            if value != neutral and value is not None:
                raise InvalidRequest(
                    f"sampling_params.{key}={value!r} is not supported by the built-in engine"
                )
        unknown = sorted(set(raw) - _ACCEPTED)
        if unknown:
            raise InvalidRequest(f"unknown sampling_params: {', '.join(unknown)}")
        raw.pop("spaces_between_special_tokens", None)
        raw.pop("custom_params", None)
        stop = raw.pop("stop", None) or []
        params = cls(
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=list(raw.pop("stop_token_ids", None) or []),
            **{k: v for k, v in raw.items() if v is not None},
        )
        params.validate()
        return params

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise InvalidRequest(f"max_new_tokens must be >= 0, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a non-empty string or a list of them")


@dataclass
class Update:
    """A snapshot sent to the HTTP side: new state of one request."""

    output_ids: list[int]
    logprobs: list[float]
    finished: bool
    finish_reason: dict[str, Any] | None
    cached_tokens: int
    weight_version: str
    num_retractions: int


@dataclass
class GenRequest:
    """One request's state, owned by the scheduler thread once submitted."""

    input_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    stream: bool = False
    logprob_start_len: int = -1
    dp_rank: int | None = None
    emit: Callable[[Update], None] = lambda update: None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    cached_tokens: int = 0
    num_retractions: int = 0
    prefilled: bool = False
    finish_reason: dict[str, Any] | None = None
    generator: torch.Generator | None = None
    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def snapshot(self, weight_version: str) -> Update:
        return Update(
            output_ids=list(self.output_ids),
            logprobs=list(self.output_logprobs),
            finished=self.finished,
            finish_reason=self.finish_reason,
            cached_tokens=self.cached_tokens,
            weight_version=weight_version,
            num_retractions=self.num_retractions,
        )
