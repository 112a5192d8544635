"""The tagged reply format's parser, and the reply and observation pieces every protocol shares.

Each assistant reply may hold, in any order:

    <analysis>what the model concluded and plans (free text, optional)</analysis>
    <command timeout="10">shell command, may span lines</command>    (zero or more)
    <task_complete/>                                                 (when done)

Commands run in order in the episode's shell (shell_session.py), each killed after its
`timeout` seconds (default and cap from the agent config). The next user turn shows each
command with its output and exit status, the whole cut to its head and tail when long. The
system prompt and the other protocols are in protocols/ (see protocol.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.sandbox.provider import ExecResult

_COMMAND = re.compile(r'<command(?:\s+timeout\s*=\s*"([^"]*)")?\s*>(.*?)</command>', re.DOTALL)
_COMPLETE = re.compile(r"<task_complete\s*/?>")
_ANALYSIS = re.compile(r"<analysis>(.*?)</analysis>", re.DOTALL)


@dataclass(frozen=True)
class Command:
    """One command the model asked for."""

    text: str
    timeout_s: float


@dataclass(frozen=True)
class Reply:
    """An assistant reply, parsed."""

    analysis: str
    commands: list[Command]
    task_complete: bool
    problems: list[str]


def parse_reply(text: str, default_timeout_s: float, max_timeout_s: float) -> Reply:
    """Read the commands and the completion flag out of a reply; note what was malformed."""
    problems: list[str] = []
    commands: list[Command] = []
    for match in _COMMAND.finditer(text):
        raw_timeout, body = match.group(1), match.group(2).strip("\n")
        timeout_s = default_timeout_s
        if raw_timeout is not None:
            try:
                timeout_s = float(raw_timeout)
            except ValueError:
                problems.append(f"timeout {raw_timeout!r} is not a number; used "
                                f"{default_timeout_s:g} s")
        if timeout_s > max_timeout_s or timeout_s <= 0:
            problems.append(f"timeout {timeout_s:g} s is outside (0, {max_timeout_s:g}]; clamped")
            timeout_s = min(max(timeout_s, 1.0), max_timeout_s)
        if body.strip():
            commands.append(Command(body, timeout_s))
        else:
            problems.append("an empty <command> was ignored")
    analysis = _ANALYSIS.search(text)
    complete = _COMPLETE.search(text) is not None
    if not commands and not complete:
        problems.append("no <command> and no <task_complete/> found in the reply")
    return Reply(analysis.group(1).strip() if analysis else "", commands, complete, problems)


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and tail of `text` within `max_chars`, marking what was cut."""
    if len(text) <= max_chars:
        return text
    half = max(max_chars // 2, 1)
    omitted = len(text) - 2 * half
    return f"{text[:half]}\n[... {omitted} characters omitted ...]\n{text[-half:]}"


def format_command_result(command: Command, result: ExecResult) -> str:
    """One command's block in the observation."""
    if result.timed_out:
        status = f"[killed: timed out after {command.timeout_s:g} s]"
    else:
        status = f"[exit code {result.exit_code}]"
    output = result.output
    if output and not output.endswith("\n"):
        output += "\n"
    return f"$ {command.text}\n{output}{status}"


def format_observation(blocks: list[str], problems: list[str], max_chars: int) -> str:
    """The next user turn: the command blocks, then any format problems, cut to size."""
    parts = list(blocks)
    if problems:
        parts.append("Note: " + "; ".join(problems) + ".")
    if not parts:
        parts.append("(no commands were run)")
    return truncate_middle("\n".join(parts), max_chars)
