"""The tagged protocol: `<analysis>`, zero or more `<command timeout="N">`, `<task_complete/>`.

Parsing is reply_format.parse_reply; a reply holding `<task_complete/>` ends the episode after
its commands ran.
"""

from __future__ import annotations

from services.sandbox.protocol import SCRIPTED_THOUGHT, AgentProtocol
from services.sandbox.reply_format import Reply, parse_reply

_PROMPT = """You are an expert engineer working in a Linux terminal to solve a task.
Reply in this format:
<analysis>what you observed and what you will do next</analysis>
<command timeout="SECONDS">a shell command</command>
You may send several <command> blocks in one reply; they run in order with bash and {state}.
Each is killed after its timeout (default {default_timeout_s:g} s, at most {max_timeout_s:g} s).
You will see each command's output and exit code.
When the task is done, reply with <task_complete/> (after any final commands).

Example. Task: "Write the number of lines of /app/data.txt to /app/count.txt."
Your first reply:
{example}
You would then see the command's output and exit code, and reply:
<analysis>The count is written.</analysis>
<task_complete/>"""

_EXAMPLE = """<analysis>I count the lines with wc and write the number.</analysis>
<command timeout="10">wc -l < /app/data.txt > /app/count.txt && cat /app/count.txt</command>"""


class TaggedProtocol(AgentProtocol):
    """Riptide's original XML-tagged reply format."""

    type = "tagged"

    prompt_template = _PROMPT
    example_reply = _EXAMPLE

    def parse(self, text: str) -> Reply:
        return parse_reply(text, self.limits.default_command_timeout_s,
                           self.limits.max_command_timeout_s)

    def script(self, commands: list[str], timeout_s: float,
               thought: str = SCRIPTED_THOUGHT) -> list[str]:
        turns = [f"<analysis>{thought}</analysis>\n"
                 f'<command timeout="{timeout_s:g}">{command}</command>' for command in commands]
        return [*turns, "<analysis>Done.</analysis>\n<task_complete/>"]
