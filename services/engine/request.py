"""One generation request inside the engine: its sampling parameters and its running state.

The HTTP layer parses SGLang's `GenerateReqInput` into `GenRequest`s; the scheduler advances
them and reports every change through `emit`, a thread-safe callback.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.common.errors import InvalidRequest
from services.engine.random_stream import RandomStream
from services.engine.routed_experts import encode_routed_experts

if TYPE_CHECKING:
    import torch

# SGLang parameters accepted only at their neutral value (the built-in engine does not implement
# them); anything else is a 400 rather than a silently different distribution.
_NEUTRAL = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
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
    "logit_bias",
    "n",
}
# Accepted and without effect here: detokenizer spacing, custom logit processors' arguments,
# and how often a stream sends a chunk (the built-in engine sends one per token).
_NO_EFFECT = {"spaces_between_special_tokens", "custom_params", "stream_interval"}


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
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1
    explicit_max_new_tokens: bool = False  # the request set it (then it must fit the context)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> SamplingParams:
        raw = dict(raw or {})
        explicit = raw.get("max_new_tokens") is not None
        for key, neutral in _NEUTRAL.items():
            value = raw.pop(key, neutral)
            if value != neutral and value is not None:
                raise InvalidRequest(
                    f"sampling_params.{key}={value!r} is not supported by the built-in engine"
                )
        unknown = sorted(set(raw) - _ACCEPTED - _NO_EFFECT)
        if unknown:
            raise InvalidRequest(f"unknown sampling_params: {', '.join(unknown)}")
        for key in _NO_EFFECT:
            raw.pop(key, None)
        stop = raw.pop("stop", None) or []
        params = cls(
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=list(raw.pop("stop_token_ids", None) or []),
            logit_bias=_logit_bias(raw.pop("logit_bias", None)),
            explicit_max_new_tokens=explicit,
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
        if not isinstance(self.n, int) or not 1 <= self.n <= 64:
            raise InvalidRequest(f"n must be an integer in [1, 64], got {self.n!r}")


def _logit_bias(raw: Any) -> dict[int, float]:
    """SGLang's `{"token id": bias}` map (keys are strings in JSON)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidRequest("logit_bias must map token ids to biases")
    try:
        return {int(k): float(v) for k, v in raw.items()}
    except (TypeError, ValueError):
        raise InvalidRequest("logit_bias must map integer token ids to numbers") from None


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
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    #: SGLang's meta_info.routed_experts (base64 int32), on the final update when asked
    routed_experts: str | None = None


@dataclass
class GenRequest:
    """One request's state, owned by the scheduler thread once submitted."""

    input_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    stream: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    dp_rank: int | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    emit: Callable[[Update], None] = lambda update: None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # (weight version, first output index, end): which weights produced which output tokens
    version_spans: list[tuple[str, int, int]] = field(default_factory=list)
    # routed experts [n, moe_layers, top_k] of positions routed_experts_start_len onwards
    route_rows: list[torch.Tensor] = field(default_factory=list)
    num_routed: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    prefilled: bool = False
    finish_reason: dict[str, Any] | None = None
    generator: RandomStream | None = None  # set by the engine at submit
    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def record_version(self, version: str) -> None:
        """The newest output token came from weights `version`."""
        end = len(self.output_ids)
        if self.version_spans and self.version_spans[-1][0] == version:
            self.version_spans[-1] = (version, self.version_spans[-1][1], end)
        else:
            start = self.version_spans[-1][2] if self.version_spans else 0
            self.version_spans.append((version, start, end))

    @property
    def routed_until(self) -> int:
        """First position whose routes are not recorded yet (when they are asked for)."""
        return self.routed_experts_start_len + self.num_routed

    def add_routes(self, first_position: int, ids: torch.Tensor) -> None:
        """Routes of positions `first_position`, ... (rows of `ids`); keeps the new ones (a
        retracted request forwards its tokens again)."""
        if not self.return_routed_experts:
            return
        skip = self.routed_until - first_position
        if skip < 0:
            raise RuntimeError(f"request {self.rid}: no routes for positions "
                               f"{self.routed_until}..{first_position - 1}")
        if skip < len(ids):
            self.route_rows.append(ids[skip:])
            self.num_routed += len(ids) - skip

    def snapshot(self, weight_version: str) -> Update:
        return Update(
            output_ids=list(self.output_ids),
            logprobs=list(self.output_logprobs),
            finished=self.finished,
            finish_reason=self.finish_reason,
            cached_tokens=self.cached_tokens,
            weight_version=weight_version,
            num_retractions=self.num_retractions,
            weight_versions=list(self.version_spans),
            top_logprobs=list(self.output_top_logprobs),
            routed_experts=(encode_routed_experts(self.route_rows)
                            if self.return_routed_experts and self.finished else None),
        )
