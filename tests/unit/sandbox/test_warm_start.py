"""Warm-start rows: the oracle's turns, laid out token for token as an RL episode has them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services._proto.riptide.v1 import common_pb2
from services.common.errors import ConfigError
from services.common.tiny_model import build_tokenizer
from services.sandbox.agent import TerminalAgent
from services.sandbox.chat_format import ChatFormat
from services.sandbox.config import AgentConfig
from services.sandbox.model_client import GenerateResult
from services.sandbox.protocol import PROTOCOL_TYPES, make_protocol
from services.sandbox.protocols.markdown_bash import COMPLETION_LINE
from services.sandbox.provider import SandboxHandle
from services.sandbox.task import Task, TaskSet
from services.sandbox.warm_start import (
    DEFAULT_THOUGHT,
    build_rows,
    loss_spans,
    solution_turn,
    solution_turns,
)
from services.testing.fake_provider import HANDLE, FakeProvider

CHAT = ChatFormat(build_tokenizer())
STARTER = Path(__file__).resolve().parents[3] / "tasks" / "starter" / "train"
OUTPUT = "12\n"


class ScoringProvider(FakeProvider):
    """Echoes the completion line, prints OUTPUT for other commands and has the tests write
    `reward` (what the verifier reads back)."""

    def __init__(self, reward: str = "1") -> None:
        super().__init__(output_for=self._output)
        self.reward = reward

    def _output(self, command: str) -> str:
        if "reward.json reward.txt" in command:
            return f"reward.txt\n{self.reward}\n"
        if f"echo {COMPLETION_LINE}" in command:
            return COMPLETION_LINE + "\n"
        return "" if "/tests/test.sh" in command else OUTPUT

    async def upload(self, handle: SandboxHandle, local_path: Path | str, remote: str) -> None:
        return None


class EngineReplay:
    """Returns each turn's ids as an engine would (text ids and the stop token, log-probs)."""

    def __init__(self, turns: list[str]) -> None:
        self.turns = list(turns)

    async def generate(self, session_key: str, input_ids: list[int],
                       sampling: common_pb2.SamplingParams,
                       routed_experts_start: int | None = None) -> GenerateResult:
        ids = CHAT.encode(self.turns.pop(0)) + [CHAT.end_of_turn_id]
        return GenerateResult(ids, [-0.5] * len(ids), "stop", 2)

    async def close(self) -> None:
        return None


def _task_set(*names: str) -> TaskSet:
    return TaskSet([Task.load(STARTER / name) for name in names])


def test_the_solution_turn_is_solve_sh_without_shebang_and_comments(tmp_path: Path) -> None:
    task = Task.load(STARTER / "count-lines")
    assert solution_turn(task) == (DEFAULT_THOUGHT, "wc -l < /app/data.txt > /app/count.txt")
    commented = tmp_path / "two-steps"
    (commented / "solution").mkdir(parents=True)
    for part in ("task.toml", "instruction.md", "environment", "tests"):
        (commented / part).symlink_to(task.path / part)
    (commented / "solution" / "solve.sh").write_text(
        "#!/bin/bash\n# Make the folder, then the file.\nmkdir -p /app/x\n\ntouch /app/x/y\n")
    assert solution_turn(Task.load(commented)) == (
        "Make the folder, then the file.", "mkdir -p /app/x\ntouch /app/x/y")


@pytest.mark.parametrize("protocol", PROTOCOL_TYPES)
def test_rows_have_the_token_layout_of_an_rl_episode_of_the_same_turns(protocol: str) -> None:
    agent = AgentConfig(protocol=protocol)  # type: ignore[arg-type]
    tasks = _task_set("count-lines", "make-dir")
    rows = asyncio.run(build_rows(tasks, CHAT, ScoringProvider(), agent))
    assert [row.task for row in rows] == ["count-lines", "make-dir"]
    for task, row in zip(tasks, rows, strict=True):
        turns = solution_turns(task, agent)
        rl = asyncio.run(TerminalAgent(EngineReplay(turns), CHAT, ScoringProvider(), agent).run(
            HANDLE, task.instruction, "rl-1", common_pb2.SamplingParams(), 60.0))
        assert rl.finish_reason == "complete" and row.num_turns == rl.num_turns
        trace = rl.trace
        assert row.ids == trace.prompt_ids + trace.response_ids
        assert row.loss_mask == [0] * len(trace.prompt_ids) + trace.loss_mask
        assert row.reward == 1.0


def test_the_loss_covers_exactly_the_assistant_turns_of_the_chat() -> None:
    agent = AgentConfig(protocol="markdown_bash")
    task = Task.load(STARTER / "count-lines")
    (row,) = asyncio.run(build_rows(_task_set("count-lines"), CHAT, ScoringProvider(), agent))
    turns = solution_turns(task, agent)
    assert turns[0] == ("THOUGHT: " + DEFAULT_THOUGHT +
                        "\n```bash\nwc -l < /app/data.txt > /app/count.txt\n```")
    assert turns[-1].endswith(f"```bash\necho {COMPLETION_LINE}\n```")
    observation = make_protocol(agent).observation(
        make_protocol(agent).parse(turns[0]),
        ["$ wc -l < /app/data.txt > /app/count.txt\n" + OUTPUT + "[exit code 0]"])
    messages = [{"role": "system", "content": make_protocol(agent).system_prompt()},
                {"role": "user", "content": task.instruction},
                {"role": "assistant", "content": turns[0]},
                {"role": "user", "content": observation},
                {"role": "assistant", "content": turns[1]}]
    rendered = CHAT.tokenizer.apply_chat_template(messages, tokenize=False)
    # The chat template's rendering, up to the last assistant turn's end-of-turn token.
    assert rendered.endswith("<|im_end|>\n")
    assert row.ids == CHAT.encode(rendered.removesuffix("\n"))
    spans = loss_spans(row.loss_mask)
    assert [CHAT.tokenizer.decode(row.ids[a:b]) for a, b in spans] == [
        turn + "<|im_end|>" for turn in turns]
    assert sum(row.loss_mask) == sum(len(CHAT.encode(t)) + 1 for t in turns)


def test_an_oracle_that_fails_its_tests_is_an_error_naming_the_task() -> None:
    agent = AgentConfig(protocol="markdown_bash")
    with pytest.raises(ConfigError, match="make-dir.*scored 0"):
        asyncio.run(build_rows(_task_set("make-dir"), CHAT, ScoringProvider(reward="0"), agent))
