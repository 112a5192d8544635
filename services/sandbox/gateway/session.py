"""One episode behind the gateway: its key, its limits, its tokens, what it was told.

A session lives exactly as long as its episode (the harness agent opens and closes it). Each
call is matched in token space against the session's tokens so far (SegmentedTrace): a prompt
that extends them appends only its new ids (loss mask 0); one that does not opens a segment
with its cause. The generated ids are appended as the engine returned them (loss mask 1, its
log-probs and weight versions). Calls of one session run one at a time, so the tokens they
extend are never raced. Caps (calls, context tokens, wall time) raise `GatewayLimit`.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NoReturn

from services._proto.riptide.v1 import common_pb2
from services.common import metrics
from services.common.errors import InvalidRequest, RiptideError, Unavailable
from services.sandbox.gateway.chat_render import ChatRenderer, Reply, reply_fingerprint
from services.sandbox.gateway.tool_calls import ParsedReply, parse_reply
from services.sandbox.model_client import GenerateResult, ModelClient
from services.sandbox.token_trace import SegmentedTrace

CALLS = metrics.counter("riptide_gateway_calls_total", "model calls answered by the agent gateway")
TOKENS = metrics.counter("riptide_gateway_tokens_total", "tokens of gateway calls: appended "
                         "(new context of a call that extended the episode) or generated",
                         ("kind",))
SEGMENTS = metrics.counter("riptide_gateway_segments_opened_total",
                           "segments opened after an episode's first, by cause", ("cause",))
REFUSED = metrics.counter("riptide_gateway_refused_total", "gateway calls refused, by code",
                          ("code",))
_APPENDED, _GENERATED = TOKENS.labels("appended"), TOKENS.labels("generated")

HISTORY_REWRITTEN = "history_rewritten"
TEMPLATE_MISMATCH = "template_mismatch"
PROMPT_REWRITTEN = "prompt_rewritten"


class GatewayLimit(RiptideError):
    """An episode's cap was reached; `code` is the OpenAI error code, `finish_reason` the
    agent's word for how the episode ended."""

    def __init__(self, message: str, http_status: int, code: str, finish_reason: str) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.code = code
        self.finish_reason = finish_reason


@dataclass(frozen=True)
class SessionLimits:
    max_calls: int
    max_context_tokens: int
    max_new_tokens: int
    deadline: float  # time.monotonic()


@dataclass
class CallOutcome:
    """One answered call: the reply, and the counts `usage` reports."""

    text: str
    parsed: ParsedReply
    result: GenerateResult
    prompt_tokens: int


@dataclass
class GatewayStats:
    """Counters of the gateway, over every session (admin state and metrics)."""

    calls: int = 0
    tokens_appended: int = 0
    tokens_generated: int = 0
    segments_opened: Counter[str] = field(default_factory=Counter)
    template_mismatches: int = 0
    refused: Counter[str] = field(default_factory=Counter)

    def call(self) -> None:
        self.calls += 1
        CALLS.inc()

    def appended(self, count: int) -> None:
        self.tokens_appended += count
        _APPENDED.inc(count)

    def generated(self, count: int) -> None:
        self.tokens_generated += count
        _GENERATED.inc(count)

    def segment_opened(self, cause: str) -> None:
        self.segments_opened[cause] += 1
        self.template_mismatches += cause == TEMPLATE_MISMATCH
        SEGMENTS.labels(cause).inc()

    def refusal(self, code: str) -> None:
        self.refused[code] += 1
        REFUSED.labels(code).inc()

    def snapshot(self) -> dict[str, Any]:
        return {"calls": self.calls, "tokens_appended": self.tokens_appended,
                "tokens_generated": self.tokens_generated,
                "segments_opened": dict(self.segments_opened),
                "template_mismatches": self.template_mismatches, "refused": dict(self.refused)}


class GatewaySession:
    """The gateway's side of one episode."""

    def __init__(self, episode_id: str, model: ModelClient, renderer: ChatRenderer,
                 sampling: common_pb2.SamplingParams, limits: SessionLimits,
                 stats: GatewayStats, parse_tools: bool,
                 route_shape: tuple[int, int] | None = None) -> None:
        self.episode_id = episode_id
        self.key = secrets.token_urlsafe(32)
        self.model = model
        self.renderer = renderer
        self.sampling = sampling
        self.limits = limits
        self.stats = stats
        self.parse_tools = parse_tools
        self.trace = SegmentedTrace(route_shape=route_shape)
        # The assistant turns the next chat call's history should hold (the last call's and
        # its reply), and every reply's ids by fingerprint.
        self.history: list[Reply] = []
        self.replies: dict[str, list[int]] = {}
        self.num_calls = 0
        self.limit_hit = ""  # the finish_reason of a cap the harness ran into
        self.aborted = False  # the engine aborted a call: the episode gets no verdict
        self.generate_s = 0.0
        self.last: GenerateResult | None = None
        self.turns: list[dict[str, Any]] = []
        self.prompt_tokens = self.cached_tokens = 0
        self._completion_text = ""  # /v1/completions: text whose ids are the segment's
        # The last call's (max_new_tokens, stop strings) and the sampling parameters made of them
        self._last_sampling_key: tuple[int, tuple[str, ...]] | None = None
        self._last_sampling = common_pb2.SamplingParams()
        self._lock = asyncio.Lock()

    def _routes_start(self) -> int | None:
        current = self.trace.current
        return None if current is None else current.routes_start

    def authorized(self, key: str) -> bool:
        return hmac.compare_digest(key.encode(), self.key.encode())

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   request: dict[str, Any]) -> CallOutcome:
        """Answer a chat completion: render, match, generate, record."""
        async with self._lock:
            self._check_call()
            rendered = self.renderer.render(messages, tools, self.history, self.replies)
            cause = HISTORY_REWRITTEN if not rendered.history_is_ours else TEMPLATE_MISMATCH
            outcome = await self._call(rendered.ids, cause, request, messages=True)
            ids = list(outcome.result.output_ids)
            fingerprint = reply_fingerprint(outcome.parsed.content, outcome.parsed.tool_calls)
            self.replies[fingerprint] = ids
            self.history = [*rendered.assistants, Reply(fingerprint, ids)]
            return outcome

    async def complete(self, prompt: str | list[int], request: dict[str, Any]) -> CallOutcome:
        """Answer a plain completion: a prompt that starts with the text so far reuses its ids."""
        async with self._lock:
            self._check_call()
            if isinstance(prompt, list):
                ids = prompt
            elif self._completion_text and prompt.startswith(self._completion_text):
                current = self.trace.current
                known = current.ids if current is not None else []
                ids = known + self.renderer.encode(prompt[len(self._completion_text):])
            else:
                ids = self.renderer.encode(prompt)
            outcome = await self._call(ids, PROMPT_REWRITTEN, request, messages=False)
            self._completion_text = (prompt + outcome.text) if isinstance(prompt, str) else ""
            return outcome

    def _check_call(self) -> None:
        if time.monotonic() >= self.limits.deadline:
            self._refuse(GatewayLimit(f"episode {self.episode_id} is out of wall time", 408,
                                      "episode_wall_time_exceeded", "wall_time"))
        if self.num_calls >= self.limits.max_calls:
            self._refuse(GatewayLimit(
                f"episode {self.episode_id} made its {self.limits.max_calls} calls "
                "(sandbox.agent.max_turns)", 429, "max_calls_exceeded", "max_turns"))

    def _refuse(self, limit: GatewayLimit) -> NoReturn:
        self.limit_hit = self.limit_hit or limit.finish_reason
        self.stats.refusal(limit.code)
        raise limit

    async def _call(self, ids: list[int], cause: str, request: dict[str, Any],
                    messages: bool) -> CallOutcome:
        room = self.limits.max_context_tokens - len(ids) - 1
        if room <= 0:
            # OpenAI's wording: clients (litellm, hence Harbor and mini-swe-agent) recognize
            # a context overflow by it, and summarize or stop instead of retrying.
            self._refuse(GatewayLimit(
                f"This model's maximum context length is {self.limits.max_context_tokens} "
                f"tokens. However, your messages resulted in {len(ids)} tokens, and the reply "
                f"needs at least one (episode {self.episode_id}; sandbox.agent."
                "max_context_tokens). Please reduce the length of the messages.",
                400, "context_length_exceeded", "context_length"))
        params = self._sampling(request, room)
        self.num_calls += 1
        self.stats.call()
        segment = self.trace.current
        known = segment.num_tokens if segment is not None else 0
        opened = self.trace.extend_or_open(ids, cause)
        if opened:
            self.stats.segment_opened(opened)
        elif segment is self.trace.current:
            self.stats.appended(len(ids) - known)
        started = time.monotonic()
        try:
            async with asyncio.timeout(max(0.001, self.limits.deadline - started)):
                result = await self.model.generate(self.episode_id, ids, params,
                                                   self._routes_start())
        except TimeoutError:
            self._refuse(GatewayLimit(f"episode {self.episode_id} ran out of wall time while "
                                      "generating", 408, "episode_wall_time_exceeded",
                                      "wall_time"))
        finally:
            self.generate_s += time.monotonic() - started
        current = self.trace.current
        assert current is not None
        current.add_model(result)
        if result.finish_reason == "abort":
            self.aborted = True
            raise Unavailable(f"the engine aborted this call of episode {self.episode_id}; "
                              "the episode will get no verdict")
        self.stats.generated(len(result.output_ids))
        self.last = result
        self.prompt_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens
        text = self.renderer.decode_reply(result.output_ids)
        parsed = parse_reply(text, self.parse_tools) if messages else ParsedReply(text)
        self.turns.append({"assistant": text, "commands": [], "observation": ""})
        return CallOutcome(text, parsed, result, len(ids))

    def _sampling(self, request: dict[str, Any], room: int) -> common_pb2.SamplingParams:
        asked = request.get("max_completion_tokens") or request.get("max_tokens")
        cap = self.sampling.max_new_tokens or self.limits.max_new_tokens
        stop = request.get("stop")
        key = (max(1, min(int(asked) if asked else cap, cap, room)),
               (stop,) if isinstance(stop, str) else tuple(stop or ()))
        # A harness asks the same of every call: the last call's parameters serve again.
        if key != self._last_sampling_key:
            self._last_sampling_key, self._last_sampling = key, self._sampling_params(*key)
        return self._last_sampling

    def _sampling_params(self, max_new_tokens: int, stop: tuple[str, ...]
                         ) -> common_pb2.SamplingParams:
        # The run's sampling (temperature, top_p, top_k) holds whatever the harness asks: the
        # trainer's log-probs are of the distribution the engine sampled from.
        params = common_pb2.SamplingParams()
        params.CopyFrom(self.sampling)
        params.max_new_tokens = max_new_tokens
        params.stop.extend(stop)
        for token in self.renderer.end_of_turn_ids:
            if token not in params.stop_token_ids:
                params.stop_token_ids.append(token)
        return params


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages, or InvalidRequest naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{index}] must be an object with a 'role'")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if any(not isinstance(t, str) for t in texts) or len(texts) != len(content):
                raise InvalidRequest(f"messages[{index}].content: only text parts are served")
            message["content"] = "".join(texts)  # type: ignore[arg-type]
        elif content is None:
            message["content"] = ""
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{index}].content must be a string or text parts")
    return messages
