"""Terminus-2's JSON protocol, the reference agent of terminal-bench-2.

Each reply is one JSON object:

    {"analysis": "...", "plan": "...",
     "commands": [{"keystrokes": "ls -la\\n", "duration": 1.0}], "task_complete": false}

Keystrokes end with a newline and run in order in the episode's shell; since commands here
run to completion rather than being typed into a terminal, a command may take up to
max(duration, the default command timeout) seconds (capped), and the control keys `C-c` and
`C-d` have no process to act on and are skipped with a note. The first reply with
`"task_complete": true` is asked to confirm; the next one that says so again ends the episode
(any other reply withdraws the request).
"""

from __future__ import annotations

import json
from typing import Any

from services.sandbox.protocol import SCRIPTED_THOUGHT, AgentProtocol
from services.sandbox.provider import ExecResult
from services.sandbox.reply_format import Command, Reply, format_observation

CONFIRM = ("Are you sure you want to mark the task as complete? This will trigger your "
           "solution to be graded and you won't be able to make any further corrections. "
           'If so, include "task_complete": true in your JSON response again.')
_CONTROL_KEYS = {"C-c", "C-d", "C-z", "C-l"}

_PROMPT = """You are an AI assistant solving a task in a Linux terminal.
Reply with ONE JSON object and nothing else:
{{
  "analysis": "what you see in the terminal and what it means",
  "plan": "what the next commands do and why",
  "commands": [{{"keystrokes": "a shell command ending with a newline\\n", "duration": 1.0}}],
  "task_complete": false
}}
Keystrokes run in order in bash and {state}. "duration" is the seconds you expect a command to
take; a command may run for max(duration, {default_timeout_s:g}) seconds, at most
{max_timeout_s:g}. You will see each command's output and exit code. When the task is done, set
"task_complete": true (you will be asked to confirm once; then say it again).

Example. Task: "Write the number of lines of /app/data.txt to /app/count.txt."
Your first reply:
{example}
You would then see the output and reply with "commands": [] and "task_complete": true."""

_EXAMPLE = json.dumps({
    "analysis": "The task needs the line count of /app/data.txt in /app/count.txt.",
    "plan": "Count the lines with wc, write the number and show it.",
    "commands": [{"keystrokes": "wc -l < /app/data.txt > /app/count.txt && cat /app/count.txt\n",
                  "duration": 1.0}],
    "task_complete": False}, indent=2)


def _first_object(text: str) -> dict[str, Any] | None:
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            return value
        start = text.find("{", start + 1)
    return None


class Terminus2Protocol(AgentProtocol):
    """JSON replies with analysis, plan, keystrokes and a confirmed task_complete."""

    type = "terminus2"

    def __init__(self, limits: Any) -> None:
        super().__init__(limits)
        self.pending_completion = False

    prompt_template = _PROMPT
    example_reply = _EXAMPLE

    def parse(self, text: str) -> Reply:
        problems: list[str] = []
        data = _first_object(text)
        if data is None:
            self.pending_completion = False
            return Reply("", [], False, ["no JSON object found; reply with one JSON object "
                                         "with analysis, plan, commands and task_complete"])
        missing = [k for k in ("analysis", "plan", "commands") if k not in data]
        if missing:
            problems.append(f"missing field(s): {', '.join(missing)}")
        commands = self._commands(data.get("commands", []), problems)
        complete = data.get("task_complete", False) is True
        confirmed = complete and self.pending_completion
        self.pending_completion = complete and not confirmed
        analysis = f"{data.get('analysis', '')}\n{data.get('plan', '')}".strip()
        return Reply(analysis, commands, confirmed, problems)

    def _commands(self, raw: Any, problems: list[str]) -> list[Command]:
        if not isinstance(raw, list):
            problems.append('"commands" must be a list of {"keystrokes", "duration"} objects')
            return []
        commands = []
        for i, item in enumerate(raw):
            keys = item.get("keystrokes") if isinstance(item, dict) else None
            if not isinstance(keys, str):
                problems.append(f"commands[{i}] has no string \"keystrokes\"; skipped")
                continue
            if keys.strip() in _CONTROL_KEYS:
                problems.append(f"commands[{i}]: {keys.strip()} skipped (no command is running)")
                continue
            if keys and not keys.endswith("\n"):
                problems.append(f"commands[{i}]: keystrokes should end with a newline")
            duration = item.get("duration", 1.0)
            if not isinstance(duration, int | float) or isinstance(duration, bool):
                problems.append(f"commands[{i}]: duration {duration!r} is not a number")
                duration = 1.0
            timeout_s = self.clamp_timeout(
                max(float(duration), self.limits.default_command_timeout_s), problems)
            if keys.strip():
                commands.append(Command(keys.rstrip("\n"), timeout_s))
        return commands

    def finished(self, reply: Reply, results: list[ExecResult]) -> bool:
        return reply.task_complete

    def observation(self, reply: Reply, blocks: list[str]) -> str:
        text = format_observation(blocks, reply.problems, self.limits.max_observation_chars)
        return f"{text}\n\n{CONFIRM}" if self.pending_completion else text

    def script(self, commands: list[str], timeout_s: float,
               thought: str = SCRIPTED_THOUGHT) -> list[str]:
        def turn(keys: list[str], complete: bool) -> str:
            return json.dumps({"analysis": thought, "plan": "Run the scripted commands.",
                               "commands": [{"keystrokes": k + "\n", "duration": timeout_s}
                                            for k in keys],
                               "task_complete": complete})
        return [*(turn([c], False) for c in commands), turn([], True), turn([], True)]
