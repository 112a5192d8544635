"""A gateway session: token matching, caps refused before any engine call, the run's sampling."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from services._proto.riptide.v1 import common_pb2
from services.common.errors import Unavailable
from services.common.tiny_model import build_tokenizer
from services.sandbox.gateway.chat_render import ChatRenderer
from services.sandbox.gateway.session import (
    GatewayLimit,
    GatewaySession,
    GatewayStats,
    SessionLimits,
)
from services.sandbox.model_client import GenerateResult
from services.sandbox.token_trace import SegmentedTrace
from services.testing.routed_model import AnswersRoutes

TOKENIZER = build_tokenizer()
EOT = TOKENIZER.eos_token_id


class RecordingModel:
    """Answers each call with the next scripted ids and records what it was sent."""

    def __init__(self, replies: list[list[int]], finish: str = "stop") -> None:
        self.replies = replies
        self.finish = finish
        self.calls: list[tuple[str, list[int], common_pb2.SamplingParams]] = []

    async def generate(self, session_key: str, input_ids: list[int],
                       sampling: common_pb2.SamplingParams,
                       routed_experts_start: int | None = None) -> GenerateResult:
        self.calls.append((session_key, list(input_ids), sampling))
        ids = self.replies[len(self.calls) - 1]
        return GenerateResult(ids, [-0.1 * (i + 1) for i in range(len(ids))], self.finish, 2)

    async def close(self) -> None:
        pass


def session(model: RecordingModel, **limits: Any) -> GatewaySession:
    caps = {"max_calls": 5, "max_context_tokens": 4096, "max_new_tokens": 64,
            "deadline": time.monotonic() + 60, **limits}
    return GatewaySession("ep-1", model, ChatRenderer(TOKENIZER, TOKENIZER.chat_template, {EOT}),
                          common_pb2.SamplingParams(temperature=0.8, top_p=0.9),
                          SessionLimits(**caps), GatewayStats(), parse_tools=False)


def chat(s: GatewaySession, messages: list[dict[str, Any]], **request: Any) -> Any:
    return asyncio.run(s.chat([dict(m) for m in messages], None, request))


def test_a_multi_turn_chat_is_one_segment_of_exactly_what_the_engine_saw() -> None:
    model = RecordingModel([[ord("a"), EOT], [0xC3, ord("b"), EOT]])
    s = session(model)
    history = [{"role": "user", "content": "hi"}]
    first = chat(s, history)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "go"}]
    second = chat(s, history, temperature=0.0, max_tokens=10)
    (segment,) = s.trace.segments
    sent_first, sent_second = model.calls[0][1], model.calls[1][1]
    assert segment.prompt_ids == sent_first
    assert sent_second[:len(sent_first) + 2] == sent_first + [ord("a"), EOT]
    assert segment.ids == sent_second + [0xC3, ord("b"), EOT]
    assert segment.loss_mask == [1, 1] + [0] * (len(sent_second) - len(sent_first) - 2) + [1] * 3
    assert segment.logprobs[-3:] == pytest.approx([-0.1, -0.2, -0.3])
    params = model.calls[1][2]
    assert params.temperature == pytest.approx(0.8)  # the run's, not the harness's 0.0
    assert params.max_new_tokens == 10 and EOT in params.stop_token_ids
    assert second.prompt_tokens == len(sent_second)
    assert s.stats.calls == 2
    assert s.stats.tokens_appended == len(sent_second) - len(sent_first) - 2  # context only


def test_a_rewritten_history_opens_a_second_segment_with_its_cause() -> None:
    model = RecordingModel([[ord("a"), EOT], [ord("c"), EOT]])
    s = session(model)
    first = chat(s, [{"role": "user", "content": "hi"}])
    assert first.text == "a"
    chat(s, [{"role": "user", "content": "summary: said hi, got a"}])
    assert [seg.cause for seg in s.trace.segments] == ["", "history_rewritten"]
    assert s.trace.segments[1].prompt_ids == model.calls[1][1]
    assert s.stats.segments_opened == {"history_rewritten": 1}


def test_calls_that_extend_a_rewritten_history_stay_in_its_segment() -> None:
    # A harness that starts over (or summarizes) once, then goes on from there: one new
    # segment, not one per call. (Matching against the episode's first replies would call
    # every later call a rewrite.)
    # 0xC3 alone decodes to U+FFFD, which re-encodes as other ids: only splicing keeps them.
    odd = [0xC3, ord("b"), EOT]
    model = RecordingModel([[ord("a"), EOT], odd, odd, [ord("d"), EOT]])
    s = session(model)
    chat(s, [{"role": "user", "content": "hi"}])
    restart = [{"role": "user", "content": "start over"}]
    second = chat(s, restart)
    restart += [{"role": "assistant", "content": second.text}, {"role": "user", "content": "go"}]
    third = chat(s, restart)
    restart += [{"role": "assistant", "content": third.text}, {"role": "user", "content": "on"}]
    chat(s, restart)
    assert [seg.cause for seg in s.trace.segments] == ["", "history_rewritten"]
    assert s.stats.segments_opened == {"history_rewritten": 1}
    assert s.trace.segments[1].ids == model.calls[3][1] + [ord("d"), EOT]
    assert s.trace.segments[1].ids[:len(model.calls[2][1]) + 3] == model.calls[2][1] + odd


def test_a_summary_that_keeps_a_reply_verbatim_gets_its_generated_ids() -> None:
    model = RecordingModel([[ord("a"), EOT], [0xC3, ord("b"), EOT], [ord("c"), EOT]])
    s = session(model)
    history = [{"role": "user", "content": "hi"}]
    first = chat(s, history)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "go"}]
    second = chat(s, history)
    chat(s, [{"role": "user", "content": "summary so far"},  # keeps only the second reply
             {"role": "assistant", "content": second.text}, {"role": "user", "content": "go"}])
    assert [seg.cause for seg in s.trace.segments] == ["", "history_rewritten"]
    rewritten = model.calls[2][1]
    assert any(rewritten[i:i + 3] == [0xC3, ord("b"), EOT] for i in range(len(rewritten)))


def test_caps_are_refused_before_any_engine_call() -> None:
    model = RecordingModel([[ord("a"), EOT]] * 3)
    s = session(model, max_calls=1, max_context_tokens=64)
    with pytest.raises(GatewayLimit) as long_prompt:
        chat(s, [{"role": "user", "content": "x" * 100}])
    assert long_prompt.value.http_status == 400
    assert long_prompt.value.code == "context_length_exceeded" and model.calls == []
    chat(s, [{"role": "user", "content": "hi"}])
    with pytest.raises(GatewayLimit) as too_many:
        chat(s, [{"role": "user", "content": "hi"}])
    assert too_many.value.http_status == 429 and len(model.calls) == 1
    assert s.limit_hit == "context_length"  # the first cap it ran into
    late = session(RecordingModel([]), deadline=time.monotonic() - 1)
    with pytest.raises(GatewayLimit) as out_of_time:
        chat(late, [{"role": "user", "content": "hi"}])
    assert out_of_time.value.code == "episode_wall_time_exceeded"


class SlowModel(RecordingModel):
    """Answers after `delay_s`, as an engine generating a long reply."""

    def __init__(self, delay_s: float, replies: list[list[int]]) -> None:
        super().__init__(replies)
        self.delay_s = delay_s

    async def generate(self, session_key: str, input_ids: list[int],
                       sampling: common_pb2.SamplingParams,
                       routed_experts_start: int | None = None) -> GenerateResult:
        await asyncio.sleep(self.delay_s)
        return await super().generate(session_key, input_ids, sampling, routed_experts_start)


def test_a_call_still_generating_at_the_deadline_is_refused_as_out_of_wall_time() -> None:
    s = session(SlowModel(30.0, [[ord("a")]]), deadline=time.monotonic() + 0.3)
    started = time.monotonic()
    with pytest.raises(GatewayLimit) as late:
        chat(s, [{"role": "user", "content": "hi"}])
    assert late.value.http_status == 408 and late.value.code == "episode_wall_time_exceeded"
    assert 0.25 < time.monotonic() - started < 5.0
    assert s.limit_hit == "wall_time" and s.stats.refused == {"episode_wall_time_exceeded": 1}


def test_calls_before_the_deadline_are_answered_and_a_cancel_from_outside_stays_a_cancel(
        ) -> None:
    s = session(SlowModel(0.05, [[ord("a"), EOT], [ord("b"), EOT], [ord("c")]]),
                deadline=time.monotonic() + 0.4)

    async def run() -> None:
        history = [{"role": "user", "content": "hi"}]
        first = await s.chat([dict(m) for m in history], None, {})
        history += [{"role": "assistant", "content": first.text},
                    {"role": "user", "content": "go"}]
        await s.chat([dict(m) for m in history], None, {})
        s.model.delay_s = 30.0  # type: ignore[attr-defined]
        call = asyncio.create_task(s.chat([{"role": "user", "content": "again"}], None, {}))
        await asyncio.sleep(0.1)
        call.cancel()  # the harness hung up: not the episode's wall time
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.4)  # past the deadline, with no call running

    asyncio.run(run())
    assert s.limit_hit == "" and not s.stats.refused and s.num_calls == 3


def test_an_aborted_call_marks_the_episode() -> None:
    s = session(RecordingModel([[ord("a")]], finish="abort"))
    with pytest.raises(Unavailable):
        chat(s, [{"role": "user", "content": "hi"}])
    assert s.aborted


class RoutingModel(AnswersRoutes, RecordingModel):
    """RecordingModel that also answers routed experts (one MoE layer, top-2 of 120)."""

    def __init__(self, replies: list[list[int]]) -> None:
        super().__init__(replies, routes_at=lambda p: np.stack([p % 60, p % 60 + 60], -1)[
            :, None, :])


def test_each_segment_records_its_routes_from_its_own_start() -> None:
    import numpy as np

    from services.common.routed_experts import unpack_routes

    model = RoutingModel([[ord("a"), EOT], [ord("b"), EOT], [ord("c"), EOT]])
    s = GatewaySession("ep-1", model, ChatRenderer(TOKENIZER, TOKENIZER.chat_template, {EOT}),
                       common_pb2.SamplingParams(), SessionLimits(5, 4096, 64,
                                                                  time.monotonic() + 60),
                       GatewayStats(), parse_tools=False, route_shape=(1, 2))
    history = [{"role": "user", "content": "hi"}]
    chat(s, history)
    chat(s, [*history, {"role": "assistant", "content": "a"}, {"role": "user", "content": "go"}])
    chat(s, [{"role": "user", "content": "summary"}])  # rewritten: a new segment from 0
    first, second = s.trace.segments
    assert model.starts == [0, len(model.calls[0][1]) + 2 - 1, 0]
    for segment in (first, second):
        n = segment.num_tokens
        routes = unpack_routes(*segment.packed_routes(), n, 1, 2)
        expected = np.arange(n - 1) % 60
        assert (routes[: n - 1, 0, 0] == expected).all() and (routes[n - 1] == -1).all()
    assert second.as_segment().routed_experts  # the segment's proto carries them


def test_each_call_gets_the_sampling_it_asks_for_within_the_caps() -> None:
    model = RecordingModel([[ord("a"), EOT]] * 4)
    s = session(model, max_new_tokens=64)
    history = [{"role": "user", "content": "hi"}]
    for request in ({"max_tokens": 10, "stop": "X"}, {"max_tokens": 10, "stop": "X"},
                    {"max_completion_tokens": 5, "stop": ["Y", "Z"]}, {}):
        chat(s, history, **request)
    asked = [(p.max_new_tokens, list(p.stop)) for _, _, p in model.calls]
    assert asked == [(10, ["X"]), (10, ["X"]), (5, ["Y", "Z"]), (64, [])]
    assert all(p.temperature == pytest.approx(0.8) and list(p.stop_token_ids) == [EOT]
               for _, _, p in model.calls)


def test_a_prompt_extends_the_tokens_so_far_only_if_it_starts_with_all_of_them() -> None:
    trace = SegmentedTrace()
    trace.extend_or_open([1, 2, 3], "")
    trace.current.add_model(GenerateResult([4, 5], [-0.1, -0.2], "stop", 1))  # type: ignore[union-attr]
    for prompt, cause in (([1, 2, 3, 4, 5, 6], ""),  # extends the prompt and the reply
                          ([1, 2, 3, 4, 5, 6], ""),  # exactly the tokens so far
                          ([1, 2, 3, 4, 9, 6, 7], "prompt_rewritten"),  # differs in the reply
                          ([1, 2, 3], "template_mismatch"),  # shorter
                          ([0, 2, 3], "history_rewritten")):  # differs in the prompt
        assert trace.extend_or_open(prompt, cause) == cause
    assert [segment.cause for segment in trace.segments] == [
        "", "prompt_rewritten", "template_mismatch", "history_rewritten"]
    assert trace.segments[0].ids == [1, 2, 3, 4, 5, 6]
