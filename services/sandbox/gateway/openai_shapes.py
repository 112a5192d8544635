"""OpenAI-shaped answers of the gateway: completions, their streamed chunks, errors.

`finish_reason` is OpenAI's word: `stop` (an end-of-turn or stop string), `length`
(max_tokens or the episode's context), `tool_calls` (the reply holds tool calls).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from services.sandbox.gateway.session import CallOutcome


def error_body(message: str, kind: str, code: str | None = None) -> bytes:
    """OpenAI's error envelope."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None,
                                   "code": code}})


def _finish(outcome: CallOutcome) -> str:
    if outcome.parsed.tool_calls:
        return "tool_calls"
    return "length" if outcome.result.finish_reason == "length" else "stop"


def _usage(outcome: CallOutcome) -> dict[str, int]:
    completion = len(outcome.result.output_ids)
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": completion,
            "total_tokens": outcome.prompt_tokens + completion}


def _message(outcome: CallOutcome) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": outcome.parsed.content}
    if outcome.parsed.tool_calls:
        message["tool_calls"] = outcome.parsed.tool_calls
    return message


def chat_completion(outcome: CallOutcome, model: str) -> bytes:
    return orjson.dumps({
        "id": f"chatcmpl-{os.urandom(12).hex()}", "object": "chat.completion",
        "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": _message(outcome), "logprobs": None,
                     "finish_reason": _finish(outcome)}],
        "usage": _usage(outcome)})


def text_completion(outcome: CallOutcome, model: str) -> bytes:
    return orjson.dumps({
        "id": f"cmpl-{os.urandom(12).hex()}", "object": "text_completion",
        "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": outcome.text, "logprobs": None,
                     "finish_reason": _finish(outcome)}],
        "usage": _usage(outcome)})


async def chat_chunks(outcome: CallOutcome, model: str, include_usage: bool
                      ) -> AsyncIterator[bytes]:
    """The answer as server-sent chat.completion.chunk events, then `[DONE]`."""
    base = {"id": f"chatcmpl-{os.urandom(12).hex()}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}

    def event(delta: dict[str, Any], finish: str | None, **more: Any) -> bytes:
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}], **more}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    yield event({"role": "assistant", "content": ""}, None)
    if outcome.parsed.content:
        yield event({"content": outcome.parsed.content}, None)
    for index, call in enumerate(outcome.parsed.tool_calls):
        yield event({"tool_calls": [{"index": index, **call}]}, None)
    yield event({}, _finish(outcome))
    if include_usage:
        yield b"data: " + orjson.dumps({**base, "choices": [], "usage": _usage(outcome)}) \
            + b"\n\n"
    yield b"data: [DONE]\n\n"


async def completion_chunks(outcome: CallOutcome, model: str, include_usage: bool
                            ) -> AsyncIterator[bytes]:
    """A plain completion as server-sent text_completion events, then `[DONE]`."""
    base = {"id": f"cmpl-{os.urandom(12).hex()}", "object": "text_completion",
            "created": int(time.time()), "model": model}
    yield b"data: " + orjson.dumps({**base, "choices": [
        {"index": 0, "text": outcome.text, "logprobs": None, "finish_reason": None}]}) + b"\n\n"
    yield b"data: " + orjson.dumps({**base, "choices": [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": _finish(outcome)}]}) \
        + b"\n\n"
    if include_usage:
        yield b"data: " + orjson.dumps({**base, "choices": [], "usage": _usage(outcome)}) \
            + b"\n\n"
    yield b"data: [DONE]\n\n"
