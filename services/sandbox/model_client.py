"""How the agent reaches a model: one small interface, two implementations.

`RouterModelClient` calls the router's gRPC `Router.Generate` (the episode's sample id as
session key, so every turn lands on the engine that caches its prefix) and `EndSession` when
the episode ends, so the router places new episodes by the ones still live. `ScriptedModelClient`
replays given assistant turns without any model; it is a test and benchmark tool (the oracle
replays the task's solve.sh; the no-op policy declares completion at once) and is selected
only by `model_client = "scripted"` in the sandbox config.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from services._proto.riptide.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.errors import DeadlineExceeded, InvalidRequest, RiptideError, Unavailable
from services.common.grpc_client import aio_channel
from services.sandbox.chat_format import ChatFormat


@dataclass(frozen=True)
class GenerateResult:
    """The tokens of one model turn, exactly as the engine produced them."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # stop, length or abort
    weight_version: int
    # Per output id, where the engine told (spans over an in-place update); else empty and
    # every id has weight_version.
    weight_versions: list[int] = field(default_factory=list)
    # Where the router sent the turn, and the engine's prompt / prefix-cache-hit counts.
    engine_url: str = ""
    dp_rank: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def token_versions(self) -> list[int]:
        """The weight version of each output id."""
        if len(self.weight_versions) == len(self.output_ids):
            return list(self.weight_versions)
        return [self.weight_version] * len(self.output_ids)


class ModelClient(Protocol):
    """Generates one assistant turn from the full token sequence so far."""

    async def generate(self, session_key: str, input_ids: list[int],
                       sampling: common_pb2.SamplingParams) -> GenerateResult: ...

    async def close(self) -> None: ...


log = logging.getLogger(__name__)
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class RouterModelClient:
    """`Router.Generate` over gRPC, with a few retries while the router is unavailable."""

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 600.0,
                 num_retries: int = 3) -> None:
        self._address, self._token = address, token
        self._channel: grpc.aio.Channel | None = None
        self._stub: router_pb2_grpc.RouterStub | None = None
        self._timeout_s = timeout_s
        self._num_retries = num_retries
        self._endings: set[asyncio.Task[None]] = set()

    async def generate(self, session_key: str, input_ids: list[int],
                       sampling: common_pb2.SamplingParams) -> GenerateResult:
        request = router_pb2.GenerateRequest(
            session_key=session_key, input_ids=input_ids, sampling_params=sampling,
            return_logprob=True, request_id=f"{session_key}-{uuid.uuid4().hex[:8]}")
        if self._stub is None:  # made on first use: an aio channel belongs to its event loop
            self._channel = aio_channel(self._address, self._token)
            self._stub = router_pb2_grpc.RouterStub(self._channel)
        for attempt in range(self._num_retries + 1):
            try:
                response = await self._stub.Generate(request, timeout=self._timeout_s)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _RETRYABLE and attempt < self._num_retries:
                    await asyncio.sleep(0.5 * 2**attempt)
                    continue
                raise _riptide_error(exc) from None
        logprobs = list(response.output_logprobs) or [0.0] * len(response.output_ids)
        return GenerateResult(list(response.output_ids), logprobs, response.finish_reason,
                              int(response.weight_version),
                              list(response.output_weight_versions), response.engine_url,
                              response.dp_rank, response.prompt_tokens, response.cached_tokens)

    def forget(self, session_key: str) -> None:
        """The episode ended: tell the router in the background (it also expires idle ones)."""
        if self._stub is None:
            return  # no turn was generated: the router never saw this session
        task = asyncio.get_running_loop().create_task(self._end_session(self._stub, session_key))
        self._endings.add(task)
        task.add_done_callback(self._endings.discard)

    async def _end_session(self, stub: router_pb2_grpc.RouterStub, session_key: str) -> None:
        try:
            await stub.EndSession(router_pb2.EndSessionRequest(session_key=session_key),
                                  timeout=10)
        except grpc.aio.AioRpcError as exc:
            log.warning("EndSession failed; the router expires the session when idle",
                        extra={"session_key": session_key, "error": exc.code().name})

    async def close(self) -> None:
        await asyncio.gather(*self._endings, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


def _riptide_error(exc: grpc.aio.AioRpcError) -> RiptideError:
    message = f"router Generate failed: {exc.code().name}: {exc.details()}"
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(message)
    return Unavailable(message)


def command_turn(command: str, timeout_s: float) -> str:
    """An assistant turn that runs one command, in the agent's reply format."""
    return (f"<analysis>Running a scripted command.</analysis>\n"
            f'<command timeout="{timeout_s:g}">{command}</command>')


COMPLETE_TURN = "<analysis>Done.</analysis>\n<task_complete/>"


class ScriptedModelClient:
    """Replays assistant turns chosen per episode, then declares the task complete.

    `script_for(session_key)` returns the turns (assistant texts) of that episode. Each
    turn's ids are the text's own encoding plus the end-of-turn token; log-probs are 0
    and the weight version is `weight_version`. Not a model: a test and benchmark tool.
    """

    def __init__(self, chat: ChatFormat, script_for: Callable[[str], list[str]],
                 weight_version: int = 0) -> None:
        self._chat = chat
        self._script_for = script_for
        self._weight_version = weight_version
        self._positions: dict[str, int] = {}

    async def generate(self, session_key: str, input_ids: list[int],
                       sampling: common_pb2.SamplingParams) -> GenerateResult:
        turns = self._script_for(session_key)
        index = self._positions.get(session_key, 0)
        self._positions[session_key] = index + 1
        text = turns[index] if index < len(turns) else COMPLETE_TURN
        ids = self._chat.encode(text) + [self._chat.end_of_turn_id]
        finish = "stop"
        if sampling.HasField("max_new_tokens") and len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        return GenerateResult(ids, [0.0] * len(ids), finish, self._weight_version)

    def forget(self, session_key: str) -> None:
        """Drop an episode's replay position once it ends."""
        self._positions.pop(session_key, None)

    async def close(self) -> None:
        self._positions.clear()
