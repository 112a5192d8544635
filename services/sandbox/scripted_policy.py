"""Assistant turns for the scripted model client: a test and benchmark tool, never a model.

`oracle` types the task's `solution/` into the sandbox and runs `solve.sh` as its one
command (what terminal-bench calls the oracle agent); `noop` declares completion without
doing anything. Both must score 1 and 0 on every bundled task, through the real service.
"""

from __future__ import annotations

from pathlib import Path

from services.common.errors import ConfigError
from services.sandbox.config import AgentConfig
from services.sandbox.protocol import make_protocol
from services.sandbox.task import Task

SOLUTION_DIR = "/solution"

#: Harmless commands a benchmark episode runs before the policy's own.
EXTRA_COMMANDS = ("pwd", "ls -la", "echo riptide > /tmp/riptide-bench.txt",
                  "wc -c /tmp/riptide-bench.txt", "uname -s")


def _heredoc(path: Path, dest: str) -> str:
    text = path.read_text()
    marker = "RIPTIDE_EOF"
    while marker in text:
        marker += "_"
    return f"cat > {dest} <<'{marker}'\n{text}{'' if text.endswith(chr(10)) else chr(10)}{marker}"


def oracle_command(task: Task) -> str:
    """One shell command that writes the task's solution files and runs solve.sh."""
    if not task.has_solution:
        raise ConfigError(f"{task.path}: no solution/solve.sh for the oracle policy")
    lines = [f"mkdir -p {SOLUTION_DIR}"]
    for path in sorted(task.solution_dir.rglob("*")):
        rel = path.relative_to(task.solution_dir).as_posix()
        if path.is_dir():
            lines.append(f"mkdir -p {SOLUTION_DIR}/{rel}")
            continue
        try:
            lines.append(_heredoc(path, f"{SOLUTION_DIR}/{rel}"))
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: binary solution files are not supported by the "
                              "oracle policy") from None
    lines.append(f"bash {SOLUTION_DIR}/solve.sh")
    return "\n".join(lines)


def scripted_turns(task: Task, policy: str, num_extra_commands: int,
                   command_timeout_s: float, agent: AgentConfig | None = None) -> list[str]:
    """The assistant turns of one scripted episode in the agent's protocol, completion last."""
    commands = [EXTRA_COMMANDS[i % len(EXTRA_COMMANDS)] for i in range(num_extra_commands)]
    if policy == "oracle":
        commands.append(oracle_command(task))
    elif policy != "noop":
        raise ConfigError(f"unknown scripted policy {policy!r}; use 'oracle' or 'noop'")
    return make_protocol(agent or AgentConfig()).script(commands, command_timeout_s)
