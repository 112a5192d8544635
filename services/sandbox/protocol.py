"""The agent protocol interface: how the model is told to act and how its replies are read.

A protocol owns the system prompt (with a worked example), the parsing of an assistant reply
into commands, the decision that the episode is finished, the next observation, and the
rendering of a list of commands as assistant turns (the scripted oracle and warm-start data
speak every protocol through it). One file per protocol in `protocols/`, chosen by
`[sandbox.agent] protocol`; `make_protocol` builds a fresh one per episode, since a protocol
may keep per-episode state (Terminus-2's completion confirmation). The agent (agent.py) calls
only this interface.
"""

from __future__ import annotations

import abc
from typing import ClassVar

from services.common.errors import ConfigError
from services.sandbox.config import AgentConfig
from services.sandbox.provider import ExecResult
from services.sandbox.reply_format import Reply, format_observation

#: The protocols `make_protocol` knows, by their `type`.
PROTOCOL_TYPES = ("tagged", "markdown_bash", "terminus2")

#: The reasoning of a scripted command turn when the caller gives none.
SCRIPTED_THOUGHT = "Running a scripted command."

STATE_NOTE = {
    True: "commands run one after another in one shell: the working directory, variables "
          "and functions carry over to later commands, as in a terminal",
    False: "each command starts in the task's working directory (directory changes and "
           "variables do not persist between commands, files do)",
}


class AgentProtocol(abc.ABC):
    """One reply format. Implementations hold per-episode state only."""

    type: ClassVar[str] = "abstract"
    #: The system prompt, with {state}, {default_timeout_s}, {max_timeout_s} and {example}.
    prompt_template: ClassVar[str] = ""
    #: A complete, valid reply that runs a command (quoted in the system prompt).
    example_reply: ClassVar[str] = ""

    def __init__(self, limits: AgentConfig) -> None:
        self.limits = limits

    def system_prompt(self) -> str:
        """What the model is told before the task: the format, its limits, a worked example."""
        return self.prompt_template.format(
            state=STATE_NOTE[self.limits.persistent_shell], example=self.example_reply,
            default_timeout_s=self.limits.default_command_timeout_s,
            max_timeout_s=self.limits.max_command_timeout_s)

    @abc.abstractmethod
    def parse(self, text: str) -> Reply:
        """The commands of one assistant reply and whether it asks to finish; malformed
        parts are listed in `problems` (shown to the model next turn), never raised."""

    @abc.abstractmethod
    def script(self, commands: list[str], timeout_s: float,
               thought: str = SCRIPTED_THOUGHT) -> list[str]:
        """Assistant turns that run `commands` in order, each with `thought` as its
        reasoning, then end the episode."""

    def finished(self, reply: Reply, results: list[ExecResult]) -> bool:
        """Whether the episode ends after this reply's commands ran."""
        return reply.task_complete

    def observation(self, reply: Reply, blocks: list[str]) -> str:
        """The next user turn: each command with its output, then any format problems."""
        return format_observation(blocks, reply.problems, self.limits.max_observation_chars)

    def clamp_timeout(self, timeout_s: float, problems: list[str]) -> float:
        """`timeout_s` within (0, max_command_timeout_s], noting a clamp in `problems`."""
        cap = self.limits.max_command_timeout_s
        if timeout_s > cap or timeout_s <= 0:
            problems.append(f"timeout {timeout_s:g} s is outside (0, {cap:g}]; clamped")
            return min(max(timeout_s, 1.0), cap)
        return timeout_s


def make_protocol(limits: AgentConfig) -> AgentProtocol:
    """A fresh protocol of type `limits.protocol` for one episode."""
    if limits.protocol == "tagged":
        from services.sandbox.protocols.tagged import TaggedProtocol

        return TaggedProtocol(limits)
    if limits.protocol == "markdown_bash":
        from services.sandbox.protocols.markdown_bash import MarkdownBashProtocol

        return MarkdownBashProtocol(limits)
    if limits.protocol == "terminus2":
        from services.sandbox.protocols.terminus2 import Terminus2Protocol

        return Terminus2Protocol(limits)
    raise ConfigError(f"unknown agent protocol {limits.protocol!r}; use one of "
                      f"{', '.join(PROTOCOL_TYPES)}")
