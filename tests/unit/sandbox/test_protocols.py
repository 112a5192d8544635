"""The contract every agent protocol passes, then what is particular to each one."""

from __future__ import annotations

import asyncio
import json

import pytest

from services._proto.riptide.v1 import common_pb2
from services.common.errors import ConfigError
from services.common.tiny_model import build_tokenizer
from services.sandbox.agent import TerminalAgent
from services.sandbox.chat_format import ChatFormat
from services.sandbox.config import AgentConfig
from services.sandbox.model_client import ScriptedModelClient
from services.sandbox.protocol import PROTOCOL_TYPES, make_protocol
from services.sandbox.protocols.markdown_bash import COMPLETION_LINE
from services.sandbox.protocols.terminus2 import CONFIRM
from services.sandbox.provider import ExecResult
from services.testing.fake_provider import HANDLE, FakeProvider

CHAT = ChatFormat(build_tokenizer())
CHATTY = "I'm ready to assist! What would you like me to do?"


def echo_provider() -> FakeProvider:
    """`echo X` prints X, everything else prints nothing."""
    return FakeProvider(output_for=lambda c: c[5:] + "\n" if c.startswith("echo ") else "")


def limits(protocol: str, **kwargs: object) -> AgentConfig:
    return AgentConfig(protocol=protocol, persistent_shell=False, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("protocol", PROTOCOL_TYPES)
def test_the_system_prompt_holds_a_worked_example_the_protocol_accepts(protocol: str) -> None:
    proto = make_protocol(limits(protocol))
    assert proto.type == protocol
    assert proto.example_reply in proto.system_prompt()
    reply = proto.parse(proto.example_reply)
    assert [c.text for c in reply.commands] == [
        "wc -l < /app/data.txt > /app/count.txt && cat /app/count.txt"]
    assert not reply.problems and not reply.task_complete


@pytest.mark.parametrize("protocol", PROTOCOL_TYPES)
def test_a_scripted_episode_runs_its_commands_in_order_then_completes(protocol: str) -> None:
    commands = ["echo one", "mkdir -p /app/x && cd /app/x", "printf 'a\\nb\\n' > f.txt"]
    turns = make_protocol(limits(protocol)).script(commands, 7)
    provider = echo_provider()
    agent = TerminalAgent(ScriptedModelClient(CHAT, lambda key: turns), CHAT, provider,
                          limits(protocol))
    run = asyncio.run(agent.run(HANDLE, "task", "s", common_pb2.SamplingParams(), 60))
    assert run.finish_reason == "complete" and run.num_turns == len(turns)
    ran = [command for command, _ in provider.commands]
    assert ran[:len(commands)] == commands
    assert all(c == f"echo {COMPLETION_LINE}" for c in ran[len(commands):])


@pytest.mark.parametrize("protocol", PROTOCOL_TYPES)
def test_chat_instead_of_a_command_runs_nothing_and_says_why(protocol: str) -> None:
    proto = make_protocol(limits(protocol))
    reply = proto.parse(CHATTY)
    assert not reply.commands and not reply.task_complete and reply.problems
    assert not proto.finished(reply, [])
    assert reply.problems[0] in proto.observation(reply, [])


@pytest.mark.parametrize("protocol", PROTOCOL_TYPES)
def test_the_prompt_says_whether_the_shell_persists(protocol: str) -> None:
    persistent = make_protocol(AgentConfig(protocol=protocol)).system_prompt()  # type: ignore[arg-type]
    fresh = make_protocol(limits(protocol)).system_prompt()
    assert "carry over" in persistent and "do not persist" in fresh


def test_unknown_protocol_is_refused() -> None:
    with pytest.raises(ValueError, match="protocol"):
        AgentConfig(protocol="xml")  # type: ignore[arg-type]
    bad = AgentConfig().model_copy(update={"protocol": "xml"})
    with pytest.raises(ConfigError, match="unknown agent protocol 'xml'"):
        make_protocol(bad)


def test_markdown_runs_the_first_block_and_ends_on_the_completion_line() -> None:
    proto = make_protocol(limits("markdown_bash", default_command_timeout_s=12))
    reply = proto.parse("THOUGHT: x\n```bash\nls\n```\nand\n```sh\npwd\n```")
    assert [(c.text, c.timeout_s) for c in reply.commands] == [("ls", 12.0)]
    assert "only the first ran" in reply.problems[0]
    assert proto.finished(reply, [ExecResult(0, f"{COMPLETION_LINE}\n")])
    assert not proto.finished(reply, [ExecResult(0, "files\n")])
    assert not proto.parse("```python\nprint(1)\n```").commands


def test_terminus2_reads_keystrokes_and_asks_to_confirm_completion_once() -> None:
    proto = make_protocol(limits("terminus2", default_command_timeout_s=5,
                                 max_command_timeout_s=60))
    text = "Sure:\n" + json.dumps({
        "analysis": "a", "plan": "p", "task_complete": False,
        "commands": [{"keystrokes": "ls -la\n", "duration": 0.1},
                     {"keystrokes": "make\n", "duration": 30}, {"keystrokes": "C-c"},
                     {"keystrokes": "sleep 1\n", "duration": 999}]})
    reply = proto.parse(text)
    assert [(c.text, c.timeout_s) for c in reply.commands] == [
        ("ls -la", 5.0), ("make", 30.0), ("sleep 1", 60.0)]
    assert any("C-c skipped" in p for p in reply.problems)
    assert any("clamped" in p for p in reply.problems)

    done = json.dumps({"analysis": "a", "plan": "p", "commands": [], "task_complete": True})
    first = proto.parse(done)
    assert not proto.finished(first, []) and CONFIRM in proto.observation(first, [])
    assert proto.finished(proto.parse(done), [])

    again = make_protocol(limits("terminus2"))
    again.parse(done)
    withdrawn = again.parse(json.dumps({"analysis": "", "plan": "", "commands": []}))
    assert CONFIRM not in again.observation(withdrawn, [])
    assert not again.finished(again.parse(done), []), "a withdrawn request is asked again"
    missing = again.parse('{"commands": "ls"}')
    assert any("missing field" in p for p in missing.problems)
    assert any("must be a list" in p for p in missing.problems)
