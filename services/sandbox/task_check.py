"""A task author's checks of a task folder: its layout, then the scripted oracle and no-op.

`layout_problems` walks every subdirectory and names each problem precisely (a folder that
is no task, a task that does not load, a missing oracle solution, a verifier that never
writes its verdict, a name used twice), all of them at once rather than the first.
`scripted_rewards` runs real episodes (local sandboxes, the task's own tests) with the
scripted model client: `oracle` replays the task's solution/solve.sh and must earn reward 1,
`noop` declares completion at once and must earn 0. Called by `riptide tasks check` and
`riptide eval --scripted` (services/cli.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.sandbox.chat_format import ChatFormat
from services.sandbox.config import AgentConfig
from services.sandbox.evaluate import evaluate, task_of_sample_id
from services.sandbox.model_client import ScriptedModelClient
from services.sandbox.provider import SandboxProvider
from services.sandbox.scripted_policy import scripted_turns
from services.sandbox.task import Task, TaskFormatError, TaskSet

#: The reward each scripted policy must earn on every task.
EXPECTED_REWARD = {"oracle": 1.0, "noop": 0.0}
#: Where a verifier writes its verdict (terminal-bench-2).
VERDICT_DIR = "/logs/verifier"
LAYOUT = ("task.toml, instruction.md, environment/Dockerfile (or [environment] docker_image), "
          "tests/test.sh, solution/solve.sh")


def layout_problems(root: Path) -> tuple[list[Task], list[str]]:
    """The tasks under `root` that load, and one message per problem found (empty: none)."""
    if not root.is_dir():
        raise TaskFormatError(f"{root}: not a directory of tasks")
    tasks: list[Task] = []
    problems: list[str] = []
    by_name: dict[str, Path] = {}
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        problems.append(f"{root}: no task directories (each task is a subdirectory holding "
                        f"{LAYOUT})")
    for folder in folders:
        if not (folder / "task.toml").is_file():
            nested = next(folder.rglob("task.toml"), None) is not None
            problems.append(f"{folder}: holds task folders but is no task itself (check it "
                            "on its own)" if nested else
                            f"{folder / 'task.toml'}: missing (a task directory holds {LAYOUT})")
            continue
        try:
            task = Task.load(folder)
        except TaskFormatError as exc:
            problems.append(str(exc))
            continue
        if task.name in by_name:
            problems.append(f"{folder}: task name {task.name!r} already used by "
                            f"{by_name[task.name]}")
            continue
        by_name[task.name] = folder
        found = _task_problems(task)
        problems += found
        if not found:
            tasks.append(task)
    return tasks, problems


def _task_problems(task: Task) -> list[str]:
    """What a task that loads still lacks for the scripted checks and for training."""
    problems = []
    if not task.has_solution:
        problems.append(f"{task.solution_dir / 'solve.sh'}: missing (the oracle solution: "
                        "the oracle check replays it, and warm starts train on it)")
    texts = [p.read_text(errors="replace") for p in sorted(task.tests_dir.rglob("*"))
             if p.is_file()]
    if not any(VERDICT_DIR in text for text in texts):
        problems.append(f"{task.tests_dir / 'test.sh'}: no file under tests/ mentions "
                        f"{VERDICT_DIR} (the verifier must write its reward to "
                        f"{VERDICT_DIR}/reward.txt or reward.json)")
    return problems


async def scripted_rewards(tasks: TaskSet, policy: str, provider: SandboxProvider,
                           chat: ChatFormat, agent: AgentConfig,
                           max_concurrent_episodes: int = 4) -> dict[str, Any]:
    """One scripted episode per task: `evaluate`'s result, and per task `expected` and
    `ok` (its reward is the one `policy` must earn; an episode without verdict is not)."""
    expected = EXPECTED_REWARD[policy]
    turns = {t.name: scripted_turns(t, policy, 0, agent.max_command_timeout_s, agent)
             for t in tasks}
    model = ScriptedModelClient(chat, lambda key: turns[task_of_sample_id(key)])
    try:
        result = await evaluate(tasks, model, chat, provider, agent, num_samples=1,
                                greedy=True, max_concurrent_episodes=max_concurrent_episodes)
    finally:
        await model.close()
    for entry in result["tasks"].values():
        entry["expected"] = expected
        entry["ok"] = entry["no_verdict"] == 0 and entry["rewards"] == [expected]
    result["policy"] = policy
    result["ok"] = all(entry["ok"] for entry in result["tasks"].values())
    return result


def scripted_agent(protocol: str) -> AgentConfig:
    """The agent of scripted checks: room for a solution of any length, a task's own time."""
    return AgentConfig.model_validate({
        "protocol": protocol, "max_turns": 4, "max_new_tokens": 1 << 20,
        "max_context_tokens": 1 << 21, "default_command_timeout_s": 600.0})
