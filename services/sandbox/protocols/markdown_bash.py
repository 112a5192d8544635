"""The markdown-bash protocol (as mini-swe-agent's): one ```bash block per reply.

Each reply holds some reasoning and exactly one fenced bash block, which runs as one command
with the default timeout. The episode ends when a command prints the completion line
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` as the first line of its output (the model runs
`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`). A reply with several blocks runs the first and
says the rest were ignored; one with none is told the format again.
"""

from __future__ import annotations

import re

from services.sandbox.protocol import SCRIPTED_THOUGHT, AgentProtocol
from services.sandbox.provider import ExecResult
from services.sandbox.reply_format import Command, Reply

COMPLETION_LINE = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

_BLOCK = re.compile(r"```(?:bash|sh|shell)[ \t]*\n(.*?)```", re.DOTALL)

_PROMPT = """You are an expert engineer working in a Linux terminal to solve a task.
Every reply has a short thought and exactly ONE bash code block with the command to run:

THOUGHT: what you observed and what you will do next
```bash
one command (join several with && if needed)
```

The command runs with bash and {state}. It is killed after {default_timeout_s:g} s.
You will see its output and exit code. When the task is done, reply with
```bash
echo {completion}
```

Example. Task: "Write the number of lines of /app/data.txt to /app/count.txt."
Your first reply:
{example}
You would then see the output, and reply:
THOUGHT: The count is written, the task is done.
```bash
echo {completion}
```""".replace("{completion}", COMPLETION_LINE)

_EXAMPLE = """THOUGHT: I count the lines with wc and write the number.
```bash
wc -l < /app/data.txt > /app/count.txt && cat /app/count.txt
```"""


class MarkdownBashProtocol(AgentProtocol):
    """One markdown bash block per turn; a printed completion line ends the episode."""

    type = "markdown_bash"

    prompt_template = _PROMPT
    example_reply = _EXAMPLE

    def parse(self, text: str) -> Reply:
        blocks = [b.strip("\n") for b in _BLOCK.findall(text)]
        problems: list[str] = []
        commands = [Command(b, self.limits.default_command_timeout_s) for b in blocks[:1]
                    if b.strip()]
        if len(blocks) > 1:
            problems.append(f"the reply had {len(blocks)} bash blocks; only the first ran "
                            "(send exactly one per reply)")
        if not commands:
            problems.append("no ```bash block found; reply with exactly one ```bash block "
                            f"(run `echo {COMPLETION_LINE}` when the task is done)")
        thought = text.split("```", 1)[0].strip().removeprefix("THOUGHT:").strip()
        return Reply(thought, commands, False, problems)

    def finished(self, reply: Reply, results: list[ExecResult]) -> bool:
        return any(r.exit_code == 0 and r.output.lstrip().startswith(COMPLETION_LINE)
                   for r in results)

    def script(self, commands: list[str], timeout_s: float,
               thought: str = SCRIPTED_THOUGHT) -> list[str]:
        turns = [f"THOUGHT: {thought}\n```bash\n{command}\n```"
                 for command in commands]
        return [*turns, f"THOUGHT: Done.\n```bash\necho {COMPLETION_LINE}\n```"]
