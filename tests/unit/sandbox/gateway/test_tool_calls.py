"""Tool calls parsed from replies where the template defines `<tool_call>` blocks."""

from __future__ import annotations

import orjson

from services.sandbox.gateway.tool_calls import parse_reply, template_has_tool_calls


def test_hermes_blocks_become_openai_tool_calls() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n'
            '</tool_call>')
    parsed = parse_reply(text, parse_tools=True)
    assert parsed.content == "Let me look."
    (call,) = parsed.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "bash"
    assert orjson.loads(call["function"]["arguments"]) == {"cmd": "ls"}


def test_malformed_blocks_and_templates_without_tools_stay_text() -> None:
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_reply(broken, parse_tools=True).content == broken
    assert parse_reply(broken, parse_tools=True).tool_calls == []
    text = '<tool_call>{"name": "bash", "arguments": {}}</tool_call>'
    assert parse_reply(text, parse_tools=False).tool_calls == []
    assert template_has_tool_calls("{% if tools %}<tool_call>{% endif %}")
    assert not template_has_tool_calls("{{ messages }}") and not template_has_tool_calls(None)
