"""The multi-turn terminal agent: model turns through a ModelClient, commands in a sandbox.

Token-in, token-out: the prompt is tokenized once; each model turn's ids are appended as the
engine returned them (loss mask 1, with their log-probs and weight version); each
observation is appended as its own ids between framing ids tokenized once by ChatFormat
(loss mask 0). Nothing the model produced is ever decoded and re-encoded into the sequence.
Called by the episode runner (services/sandbox/episode.py); the reply format is the
configured protocol (protocol.py, one per episode), commands run in the episode's shell
(shell_session.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from services._proto.riptide.v1 import common_pb2
from services.common.errors import RiptideError
from services.common.events import OBSERVATION_MAX_CHARS
from services.sandbox.chat_format import ChatFormat
from services.sandbox.config import AgentConfig
from services.sandbox.failures import EngineError, model_error
from services.sandbox.model_client import GenerateResult, ModelClient
from services.sandbox.protocol import make_protocol
from services.sandbox.provider import ExecResult, SandboxHandle, SandboxProvider
from services.sandbox.reply_format import Command, format_command_result
from services.sandbox.shell_session import ShellSession
from services.sandbox.token_trace import TokenTrace

if TYPE_CHECKING:
    from services.sandbox.task import Task

ProgressFn = Callable[[str, int, str], None]


class GenerationAborted(EngineError):
    """The engine aborted a turn (a weight update, a drained engine): the episode is cut short
    by the infrastructure, not by the model, so it gets no verdict."""


@dataclass
class AgentRun:
    """What the agent did: the tokens, how it stopped and where its time went."""

    trace: TokenTrace
    #: Segments after the first (agents behind the gateway whose history did not extend).
    extra_segments: list[TokenTrace] = field(default_factory=list)
    num_turns: int = 0
    finish_reason: str = ""
    generate_s: float = 0.0
    exec_s: float = 0.0
    #: Per model turn: {"assistant": text, "commands": [...], "observation": text}, for the
    #: per-sample view of the events stream (observations cut to OBSERVATION_MAX_CHARS).
    turns: list[dict[str, Any]] = field(default_factory=list)
    engine_url: str = ""
    dp_rank: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add_turn(self, result: GenerateResult, text: str, commands: list[Command]) -> None:
        self.engine_url, self.dp_rank = result.engine_url, result.dp_rank
        self.prompt_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens
        self.turns.append({"assistant": text, "commands": [c.text for c in commands],
                           "observation": ""})


class EpisodeAgent(Protocol):
    """What the episode runner drives: the built-in agent or a harness behind the gateway."""

    config: AgentConfig

    @property
    def tokenizer(self) -> Any: ...

    async def run(self, handle: SandboxHandle, instruction: str, session_key: str,
                  sampling: common_pb2.SamplingParams, wall_time_s: float,
                  on_progress: ProgressFn | None = None, task: Task | None = None
                  ) -> AgentRun: ...


class TerminalAgent:
    """Runs one episode's turns against a live sandbox."""

    def __init__(self, model: ModelClient, chat: ChatFormat, provider: SandboxProvider,
                 config: AgentConfig) -> None:
        self.model = model
        self.chat = chat
        self.provider = provider
        self.config = config

    @property
    def tokenizer(self) -> Any:
        return self.chat.tokenizer

    def system_prompt(self) -> str:
        return make_protocol(self.config).system_prompt()

    async def run(self, handle: SandboxHandle, instruction: str, session_key: str,
                  sampling: common_pb2.SamplingParams, wall_time_s: float,
                  on_progress: ProgressFn | None = None, task: Task | None = None) -> AgentRun:
        """Turns until the model declares completion or a limit is reached."""
        progress = on_progress or (lambda kind, turn, detail: None)
        limits = self.config
        deadline = time.monotonic() + min(wall_time_s, limits.wall_time_s)
        protocol = make_protocol(limits)
        shell = ShellSession(self.provider, handle, limits.persistent_shell)
        run = AgentRun(TokenTrace(self.chat.prompt_ids(protocol.system_prompt(), instruction)))
        for turn in range(1, limits.max_turns + 1):
            # SGLang refuses prompt + max_new_tokens >= its context length (HTTP 400), so the
            # cap is exclusive: an engine whose context equals max_context_tokens accepts it.
            room = limits.max_context_tokens - run.trace.num_tokens - 1
            if room <= 0:
                run.finish_reason = "context_length"
                return run
            result = await self._generate(run, session_key, sampling, room, deadline)
            if result is None:
                run.finish_reason = "wall_time"
                return run
            run.num_turns = turn
            run.trace.add_model(result)
            if result.finish_reason == "abort":
                raise GenerationAborted(f"the engine aborted turn {turn} of {session_key}")
            text = self.chat.decode(result.output_ids)
            reply = protocol.parse(text)
            run.add_turn(result, text, reply.commands)
            progress("turn", turn, f"{len(result.output_ids)} tokens, "
                                   f"{len(reply.commands)} commands")
            results, out_of_time = await self._run_commands(run, shell, reply.commands, turn,
                                                            deadline, progress)
            if protocol.finished(reply, results):
                run.finish_reason = "complete"
                return run
            if out_of_time:
                run.finish_reason = "wall_time"
                return run
            observation = protocol.observation(
                reply, [format_command_result(c, r) for c, r in zip(reply.commands, results,
                                                                     strict=False)])
            run.turns[-1]["observation"] = observation[:OBSERVATION_MAX_CHARS]
            ids = self.chat.user_turn_ids(result.output_ids, observation)
            if run.trace.num_tokens + len(ids) >= limits.max_context_tokens:
                run.finish_reason = "context_length"
                return run
            run.trace.add_context(ids)
        run.finish_reason = "max_turns"
        return run

    async def _generate(self, run: AgentRun, session_key: str,
                        sampling: common_pb2.SamplingParams, room: int,
                        deadline: float) -> GenerateResult | None:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            return None
        params = common_pb2.SamplingParams()
        params.CopyFrom(sampling)
        asked = sampling.max_new_tokens if sampling.HasField("max_new_tokens") else \
            self.config.max_new_tokens
        params.max_new_tokens = min(asked, room)
        if self.chat.end_of_turn_id not in params.stop_token_ids:
            params.stop_token_ids.append(self.chat.end_of_turn_id)
        input_ids = run.trace.prompt_ids + run.trace.response_ids
        started = time.monotonic()
        try:
            return await asyncio.wait_for(
                self.model.generate(session_key, input_ids, params), remaining_s)
        except TimeoutError:
            return None
        except RiptideError as exc:  # the router's or engine's: a failure class of its own
            raise model_error(exc) from exc
        finally:
            run.generate_s += time.monotonic() - started

    async def _run_commands(self, run: AgentRun, shell: ShellSession,
                            commands: list[Command], turn: int, deadline: float,
                            progress: ProgressFn) -> tuple[list[ExecResult], bool]:
        results: list[ExecResult] = []
        for command in commands:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return results, True
            timeout_s = min(command.timeout_s, remaining_s)
            started = time.monotonic()
            result = await shell.run(command.text, timeout_s)
            elapsed = time.monotonic() - started
            run.exec_s += elapsed
            status = "timed out" if result.timed_out else f"exit {result.exit_code}"
            progress("command", turn, f"{status} in {elapsed:.2f} s: {command.text[:80]}")
            results.append(result)
        return results, False
