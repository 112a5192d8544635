"""Warm-start data: each task's oracle solution as one episode of the chosen agent protocol.

The assistant turns are the protocol's rendering (`AgentProtocol.script`) of the commands of
the task's `solution/solve.sh` (shebang, comments and blank lines dropped; its comments are
the turn's thought; run as one multi-line command) and then the protocol's completion turn.
They run as a real episode: the agent (agent.py) with the scripted client replaying them,
in a sandbox from the provider, scored by the task's own tests. So the observations are the
commands' real output and the tokens are laid out exactly as in an RL episode of that
protocol: the prompt, each assistant turn's ids ending with the end-of-turn token (loss
mask 1), the framing and observation between turns (loss mask 0). An oracle that does not
score full reward is an error naming the task: warm-start data never teaches a failure.

Rows are written as JSON lines `{task, ids, loss_mask, reward, num_turns}` (`ids` the whole
sequence, `loss_mask` one entry per id), the file `riptide sft` trains on
(services/trainer/sft.py). Called by services/cli.py.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.errors import ConfigError
from services.sandbox.agent import TerminalAgent
from services.sandbox.chat_format import ChatFormat
from services.sandbox.config import AgentConfig
from services.sandbox.episode import EpisodeRunner
from services.sandbox.model_client import ScriptedModelClient
from services.sandbox.protocol import make_protocol
from services.sandbox.provider import SandboxProvider
from services.sandbox.scripted_policy import oracle_command
from services.sandbox.stats import SandboxStats
from services.sandbox.task import Task, TaskSet

#: The thought of a solution turn when solve.sh has no comments to give one.
DEFAULT_THOUGHT = "I do what the task asks with one command."


@dataclass(frozen=True)
class WarmStartRow:
    """One training sequence: ids with their loss mask (1 on assistant tokens only)."""

    task: str
    ids: list[int]
    loss_mask: list[int]
    reward: float
    num_turns: int


def solution_turn(task: Task) -> tuple[str, str]:
    """(thought, command) of the task's oracle: solve.sh's commands as one block, its
    comments as the thought. A solution with files beside solve.sh runs through the oracle's
    own command, which writes them first."""
    if not task.has_solution:
        raise ConfigError(f"{task.path}: no solution/solve.sh to build warm-start data from")
    files = [p for p in task.solution_dir.rglob("*") if p.is_file()]
    lines = (task.solution_dir / "solve.sh").read_text().splitlines()
    comments = [ln.lstrip("#").strip() for ln in lines if ln.startswith("#")
                and not ln.startswith("#!")]
    thought = " ".join(c for c in comments if c) or DEFAULT_THOUGHT
    if len(files) > 1:
        return thought, oracle_command(task)
    body = "\n".join(ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))
    if not body:
        raise ConfigError(f"{task.solution_dir / 'solve.sh'}: no commands")
    return thought, body


def solution_turns(task: Task, agent: AgentConfig) -> list[str]:
    """The assistant turns of the task's warm-start episode in `agent.protocol`."""
    thought, command = solution_turn(task)
    return make_protocol(agent).script([command], agent.default_command_timeout_s, thought)


def row_of(task: Task, trajectory: common_pb2.Trajectory) -> WarmStartRow:
    """The training row of a finished warm-start episode (full reward, or ConfigError)."""
    if trajectory.status != common_pb2.VERDICT_STATUS_SCORED:
        raise ConfigError(f"{task.path}: the oracle's episode got no verdict: "
                          f"{trajectory.status_message}")
    if trajectory.reward < 1.0 or trajectory.finish_reason != "complete":
        raise ConfigError(f"{task.path}: the oracle's episode scored {trajectory.reward:g} "
                          f"({trajectory.finish_reason}); fix solution/solve.sh or drop the task")
    prompt = list(trajectory.prompt_ids)
    row = WarmStartRow(task.name, prompt + list(trajectory.response_ids),
                       [0] * len(prompt) + list(trajectory.loss_mask), trajectory.reward,
                       trajectory.num_turns)
    if len(loss_spans(row.loss_mask)) != row.num_turns:
        raise ConfigError(f"{task.path}: the oracle's episode has {row.num_turns} turns but "
                          f"{len(loss_spans(row.loss_mask))} spans of assistant tokens")
    return row


def loss_spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) index spans of the loss tokens: one per assistant turn."""
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


async def build_rows(tasks: TaskSet, chat: ChatFormat, provider: SandboxProvider,
                     agent: AgentConfig, max_concurrent_episodes: int = 4) -> list[WarmStartRow]:
    """One row per task, in the task set's order, each from a real episode of its oracle."""
    turns = {task.name: solution_turns(task, agent) for task in tasks}
    scripts: dict[str, list[str]] = {}
    client = ScriptedModelClient(chat, lambda key: scripts[key])
    runner = EpisodeRunner(provider, TerminalAgent(client, chat, provider, agent),
                           SandboxStats(), max_concurrent_episodes, max_concurrent_episodes,
                           "warm-start")
    # No cap on new tokens beyond the context: a solution turn is never cut.
    sampling = common_pb2.SamplingParams(max_new_tokens=agent.max_context_tokens)

    async def one(task: Task) -> WarmStartRow:
        sample_id = f"warm-{task.name}-{uuid.uuid4().hex[:6]}"
        scripts[sample_id] = turns[task.name]
        request = sandbox_pb2.RunEpisodeRequest(task_id=task.name, sample_id=sample_id,
                                                group_id=f"warm-{task.name}",
                                                sampling_params=sampling)
        return row_of(task, await runner.run(task, request, lambda progress: None))

    # Every episode ends (and its sandbox is deleted) before the first failure is raised.
    results = await asyncio.gather(*(one(task) for task in tasks), return_exceptions=True)
    await runner.drain_deletes(60.0)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [r for r in results if isinstance(r, WarmStartRow)]


def write_rows(rows: list[WarmStartRow], path: Path) -> Path:
    """Write `rows` as JSON lines at `path` (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text("".join(json.dumps(asdict(row)) + "\n" for row in rows))
    staging.replace(path)
    return path
