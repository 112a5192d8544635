"""Tool calls in a reply, where the model's chat template defines them.

Templates of the Hermes / Qwen family render a tool call as `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` and tell the model to answer the same way; a reply holding
such blocks becomes OpenAI `tool_calls` (the text around them stays the content). A template
that defines no tool-call format gets no parsing: the reply is text.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedReply:
    """A reply's text and tool calls, OpenAI-shaped."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def template_has_tool_calls(template: str | None) -> bool:
    """Whether the chat template defines the `<tool_call>` format."""
    return bool(template) and "<tool_call>" in str(template)


def parse_reply(text: str, parse_tools: bool) -> ParsedReply:
    """Split a reply into content and tool calls (when `parse_tools`); a block that is not
    a JSON object with a name stays in the text."""
    if not parse_tools or "<tool_call>" not in text:
        return ParsedReply(text)
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return ParsedReply(content or None, calls)


def _call(body: str) -> dict[str, Any] | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = orjson.dumps(arguments).decode()
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": parsed["name"], "arguments": arguments}}
