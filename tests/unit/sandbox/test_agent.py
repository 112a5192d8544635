"""The terminal agent: token-in token-out bookkeeping, reply parsing, limits."""

from __future__ import annotations

import asyncio

import pytest

from services._proto.riptide.v1 import common_pb2
from services.common.tiny_model import build_tokenizer
from services.sandbox.agent import GenerationAborted, TerminalAgent
from services.sandbox.chat_format import ChatFormat
from services.sandbox.config import AgentConfig
from services.sandbox.model_client import GenerateResult, ScriptedModelClient, command_turn
from services.sandbox.reply_format import parse_reply, truncate_middle
from services.testing.fake_provider import HANDLE, FakeProvider
from services.testing.routed_model import AnswersRoutes

CHAT = ChatFormat(build_tokenizer())


class ListModel:
    """Returns the given results in order and records the inputs it saw."""

    def __init__(self, results: list[GenerateResult]) -> None:
        self.results = list(results)
        self.inputs: list[list[int]] = []
        self.max_new: list[int] = []

    async def generate(self, session_key: str, input_ids: list[int],
                       sampling: common_pb2.SamplingParams,
                       routed_experts_start: int | None = None) -> GenerateResult:
        self.inputs.append(list(input_ids))
        self.max_new.append(sampling.max_new_tokens)
        return self.results.pop(0)

    async def close(self) -> None:
        return None


def _turn(text: str, version: int, finish: str = "stop") -> GenerateResult:
    ids = CHAT.encode(text) + [CHAT.end_of_turn_id]
    return GenerateResult(ids, [-0.01 * (i + 1) for i in range(len(ids))], finish, version)


def _run(agent: TerminalAgent, wall_time_s: float = 60.0):  # noqa: ANN202
    return asyncio.run(agent.run(HANDLE, "do the task", "sample-1",
                                 common_pb2.SamplingParams(max_new_tokens=512), wall_time_s))


def test_tokens_are_appended_exactly_and_masked_per_source() -> None:
    first = _turn(command_turn("echo hi", 5), version=3)
    second = _turn("<task_complete/>", version=4)
    model = ListModel([first, second])
    provider = FakeProvider(output="hi\n")
    run = _run(TerminalAgent(model, CHAT, provider, AgentConfig(persistent_shell=False)))
    trace = run.trace

    assert run.finish_reason == "complete" and run.num_turns == 2
    assert provider.commands == [("echo hi", 5.0)]
    observation = "$ echo hi\nhi\n[exit code 0]"
    framing = CHAT.user_open_ids + CHAT.encode(observation) + CHAT.assistant_open_ids
    assert trace.response_ids == first.output_ids + framing + second.output_ids
    assert model.inputs[1] == trace.prompt_ids + first.output_ids + framing
    n1, n2 = len(first.output_ids), len(second.output_ids)
    assert trace.loss_mask == [1] * n1 + [0] * len(framing) + [1] * n2
    assert trace.logprobs == first.output_logprobs + [0.0] * len(framing) + second.output_logprobs
    assert trace.weight_versions == [3] * n1 + [-1] * len(framing) + [4] * n2
    assert CHAT.tokenizer.decode(trace.prompt_ids).endswith("<|im_start|>assistant\n")


def test_a_turn_cut_by_length_is_closed_with_the_end_of_turn_token() -> None:
    cut = GenerateResult(CHAT.encode(command_turn("ls", 5)), [0.0] * 30, "length", 1)
    model = ListModel([cut, _turn("<task_complete/>", 1)])
    trace = _run(TerminalAgent(model, CHAT, FakeProvider(), AgentConfig())).trace
    after = trace.response_ids[len(cut.output_ids)]
    assert after == CHAT.end_of_turn_id
    assert trace.loss_mask[len(cut.output_ids)] == 0


def test_max_turns_and_context_limits_stop_the_episode() -> None:
    turns = [_turn(command_turn("ls", 5), 0) for _ in range(5)]
    run = _run(TerminalAgent(ListModel(turns), CHAT, FakeProvider(), AgentConfig(max_turns=3)))
    assert run.finish_reason == "max_turns" and run.num_turns == 3

    small = AgentConfig(max_context_tokens=len(CHAT.prompt_ids(
        TerminalAgent(ListModel([]), CHAT, FakeProvider(), AgentConfig()).system_prompt(),
        "do the task")) + 120)
    model = ListModel([_turn(command_turn("ls", 5), 0) for _ in range(5)])
    run = _run(TerminalAgent(model, CHAT, FakeProvider(output="x" * 500), small))
    assert run.finish_reason == "context_length"
    assert run.trace.num_tokens <= small.max_context_tokens
    assert model.max_new[0] <= 120  # max_new_tokens shrinks to the room left


@pytest.mark.parametrize(("sampling", "asked"), [
    (common_pb2.SamplingParams(), 77),  # unset: the agent's per-turn default
    (common_pb2.SamplingParams(max_new_tokens=5), 5),
])
def test_an_unset_max_new_tokens_is_the_agents_default(sampling: common_pb2.SamplingParams,
                                                      asked: int) -> None:
    model = ListModel([_turn("<task_complete/>", 0)])
    agent = TerminalAgent(model, CHAT, FakeProvider(), AgentConfig(max_new_tokens=77))
    asyncio.run(agent.run(HANDLE, "do the task", "sample-1", sampling, 60.0))
    assert model.max_new == [asked]


def test_wall_time_stops_a_slow_episode() -> None:
    turns = [_turn(command_turn("sleep", 5), 0) for _ in range(50)]
    agent = TerminalAgent(ListModel(turns), CHAT, FakeProvider(delay_s=0.1), AgentConfig())
    run = _run(agent, wall_time_s=0.35)
    assert run.finish_reason == "wall_time" and run.num_turns < 10


def test_an_aborted_generation_has_no_verdict() -> None:
    aborted = GenerateResult([65, 66], [0.0, 0.0], "abort", 0)
    with pytest.raises(GenerationAborted):
        _run(TerminalAgent(ListModel([aborted]), CHAT, FakeProvider(), AgentConfig()))


def test_scripted_client_replays_then_completes() -> None:
    client = ScriptedModelClient(CHAT, lambda key: [command_turn("pwd", 7)])
    provider = FakeProvider()
    run = _run(TerminalAgent(client, CHAT, provider, AgentConfig(persistent_shell=False)))
    assert provider.commands == [("pwd", 7.0)]
    assert run.finish_reason == "complete" and run.num_turns == 2


def test_reply_parsing_reads_commands_and_reports_problems() -> None:
    reply = parse_reply('<analysis>a</analysis><command timeout="2">ls\n-la</command>'
                        '<command>pwd</command><command timeout="9999">x</command>'
                        "<task_complete/>", 10, 600)
    assert [(c.text, c.timeout_s) for c in reply.commands] == [
        ("ls\n-la", 2.0), ("pwd", 10.0), ("x", 600.0)]
    assert reply.task_complete and reply.analysis == "a"
    assert any("clamped" in p for p in reply.problems)
    empty = parse_reply("I am not sure", 10, 600)
    assert not empty.commands and not empty.task_complete and empty.problems


def test_truncation_keeps_head_and_tail() -> None:
    text = "HEAD" + "x" * 1000 + "TAIL"
    cut = truncate_middle(text, 100)
    assert cut.startswith("HEAD") and cut.endswith("TAIL") and "omitted" in cut
    assert len(cut) < 160


def test_turns_text_and_engine_counts_are_kept_for_the_episode_detail() -> None:
    from dataclasses import replace

    first = replace(_turn(command_turn("echo hi", 5), version=3), engine_url="http://e",
                    dp_rank=1, prompt_tokens=40, cached_tokens=0)
    second = replace(_turn("<task_complete/>", version=4), engine_url="http://e", dp_rank=1,
                     prompt_tokens=70, cached_tokens=40)
    run = _run(TerminalAgent(ListModel([first, second]), CHAT, FakeProvider(output="hi\n"),
                             AgentConfig(persistent_shell=False)))
    assert [t["commands"] for t in run.turns] == [["echo hi"], []]
    assert run.turns[0]["observation"] == "$ echo hi\nhi\n[exit code 0]"
    assert "echo hi" in run.turns[0]["assistant"] and run.turns[1]["observation"] == ""
    assert (run.engine_url, run.dp_rank, run.prompt_tokens, run.cached_tokens) == (
        "http://e", 1, 110, 40)


class RoutingModel(AnswersRoutes, ListModel):
    """ListModel that also answers routed experts as an engine does (`_routes_at`)."""

    def __init__(self, results: list[GenerateResult]) -> None:
        super().__init__(results, routes_at=_routes_at)


def _routes_at(positions):  # noqa: ANN001, ANN202
    """[n, 3 MoE layers, top-2] ids of an engine with 300 experts (so uint16 on the wire)."""
    import numpy as np

    return np.stack([positions % 300, (positions + 1) % 300], axis=-1)[:, None, :].repeat(3, 1)


def test_routed_experts_are_asked_from_where_the_last_turn_ended_and_packed() -> None:
    import numpy as np

    from services.common.routed_experts import unpack_routes

    first = _turn(command_turn("echo hi", 5), version=3)
    model = RoutingModel([first, _turn("<task_complete/>", version=3)])
    run = asyncio.run(TerminalAgent(model, CHAT, FakeProvider(output="hi\n"), AgentConfig())
                      .run(HANDLE, "do the task", "sample-1",
                           common_pb2.SamplingParams(max_new_tokens=512), 60.0,
                           route_shape=(3, 2)))
    trace = run.trace
    # The second call asks from the last output id of the first, which was never forwarded.
    assert model.starts == [0, len(trace.prompt_ids) + len(first.output_ids) - 1]
    trajectory = common_pb2.Trajectory()
    trace.fill(trajectory)
    assert (trajectory.routed_experts_num_layers, trajectory.routed_experts_top_k) == (3, 2)
    n = trace.num_tokens
    assert len(trajectory.routed_experts) == 2 * (n - 1) * 3 * 2  # uint16: ids reach 299
    routes = unpack_routes(trajectory.routed_experts, trajectory.routed_experts_present, n, 3, 2)
    assert np.array_equal(routes[: n - 1], _routes_at(np.arange(n - 1)))
    assert (routes[n - 1] == -1).all()  # the final token was never forwarded


def test_without_a_route_shape_no_routes_are_asked() -> None:
    model = ListModel([_turn("<task_complete/>", 1)])
    trajectory = common_pb2.Trajectory()
    _run(TerminalAgent(model, CHAT, FakeProvider(), AgentConfig())).trace.fill(trajectory)
    assert trajectory.routed_experts == b"" and trajectory.routed_experts_num_layers == 0
