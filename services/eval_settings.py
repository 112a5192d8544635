"""The settings of `riptide eval`: from its flags, else from a run's config, else defaults.

`riptide eval --run DIR` scores a checkpoint the way that run scored it: the tasks (the run's
held-out `rollout.eval.task_ids` from its `sandbox.tasks_dir`), the agent (`sandbox.agent`,
with the rollout's `max_new_tokens`), the sampling (`rollout.eval`: greedy or its temperature,
episodes per task), the engine's arguments (`rollout.fleet.builtin_args`: dtype, threads,
device) and the weights (the run's newest checkpoint, trained from `trainer.model.hf_path`).
Any flag given overrides the run's value. Without `--run` the defaults below apply. Called by
services/cli.py before anything heavy starts, so a bad setting fails at once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.checkpoint_steps import latest_checkpoint_step
from services.common.errors import ConfigError
from services.sandbox.config import AgentConfig
from services.sandbox.task import TaskSet

#: Without --run: what a flag left out means.
DEFAULTS: dict[str, Any] = {
    "protocol": "markdown_bash", "max_turns": 4, "max_new_tokens": 96,
    "max_context_tokens": 2048, "samples": 1, "greedy": False, "temperature": 0.8,
    "engine_dtype": "auto",
}
#: The agent's time caps in an evaluation (a run's own, with --run).
EVAL_AGENT_TIMES = {"default_command_timeout_s": 10.0, "wall_time_s": 300.0}


@dataclass(frozen=True)
class EvalSettings:
    """Everything one `riptide eval` needs, resolved."""

    tasks: TaskSet
    agent: AgentConfig
    num_samples: int
    greedy: bool
    temperature: float
    engine_args: list[str]
    checkpoint: Path | None  # None: the tiny random model
    base: Path | None  # the model folder a trainer checkpoint was trained from
    run: dict[str, Any]  # where the run-derived settings came from (printed with the result)


def resolve(args: argparse.Namespace) -> EvalSettings:
    """The settings of `args` (flags of `riptide eval`), filled from `args.run`'s config."""
    run = _run_values(args.run) if args.run is not None else {}

    def pick(name: str) -> Any:
        value = getattr(args, name)
        if value is not None:
            return value
        return run[name] if name in run else DEFAULTS.get(name)

    if args.tasks is not None:
        tasks = TaskSet.load(args.tasks)  # a malformed folder fails before anything starts
    elif args.run is not None:
        tasks = _run_tasks(run["tasks_dir"], run["task_ids"])
    else:
        raise ConfigError("riptide eval needs --tasks FOLDER, or --run DIR to score the run's "
                          "held-out tasks")
    agent_base = run.get("agent") or EVAL_AGENT_TIMES
    agent = AgentConfig.model_validate({
        **agent_base, "protocol": pick("protocol"), "max_turns": pick("max_turns"),
        "max_new_tokens": pick("max_new_tokens"),
        "max_context_tokens": pick("max_context_tokens")})
    engine_args = _engine_args(run.get("builtin_args", []), args.engine_dtype,
                               args.engine_threads, args.engine_device)
    if "--dtype" not in engine_args:
        engine_args = ["--dtype", DEFAULTS["engine_dtype"], *engine_args]
    return EvalSettings(
        tasks=tasks, agent=agent, num_samples=pick("samples"), greedy=pick("greedy"),
        temperature=pick("temperature"), engine_args=engine_args,
        checkpoint=pick("checkpoint"), base=pick("base"),
        run={"dir": str(args.run), "checkpoint_step": run.get("checkpoint_step")}
        if args.run is not None else {})


def _run_values(run_dir: Path) -> dict[str, Any]:
    """The eval settings a run used, from `<run_dir>/config.toml`, by `riptide eval` flag."""
    from services.deployment import load_config

    path = run_dir / "config.toml"
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (--run names a run directory, the --dir of "
                          "`riptide up` or bench/learning.py, which holds config.toml)")
    config = load_config(path)
    step = latest_checkpoint_step(config.trainer.checkpoint.dir)
    model = Path(config.trainer.model.hf_path or config.rollout.fleet.model_path)
    evaluation, agent = config.rollout.eval, config.sandbox.agent
    return {
        "tasks_dir": Path(config.sandbox.tasks_dir),
        # The run's held-out tasks; else the tasks it trained on; else the whole folder.
        "task_ids": list(evaluation.task_ids or config.rollout.task_ids),
        "agent": agent.model_dump(),
        "protocol": agent.protocol, "max_turns": agent.max_turns,
        "max_new_tokens": config.rollout.scheduler.max_new_tokens,
        "max_context_tokens": agent.max_context_tokens,
        "samples": evaluation.num_samples, "greedy": evaluation.greedy,
        "temperature": evaluation.temperature,
        "builtin_args": list(config.rollout.fleet.builtin_args),
        # The newest checkpoint (trained from the run's model); none yet: the model itself.
        "checkpoint": Path(config.trainer.checkpoint.dir) / f"step-{step:08d}" if step
        else model,
        "base": model, "checkpoint_step": step,
    }


def _run_tasks(tasks_dir: Path, task_ids: list[str]) -> TaskSet:
    tasks = TaskSet.load(tasks_dir)
    if not task_ids:
        return tasks
    missing = [t for t in task_ids if t not in tasks]
    if missing:
        raise ConfigError(f"the run's tasks {missing} are not in its tasks_dir {tasks_dir}")
    return TaskSet([tasks.get(t) for t in task_ids])


def _engine_args(run_args: list[str], dtype: str | None, threads: int | None,
                 device: str | None = None) -> list[str]:
    """The run's engine arguments with --dtype, --num-threads and --device replaced where
    given."""
    out: list[str] = []
    replaced = {"--dtype": dtype, "--num-threads": None if threads is None else str(threads),
                "--device": device}
    skip = False
    for arg in run_args:
        if skip:
            skip = False
            continue
        if replaced.get(arg) is not None:
            skip = True  # its value follows
            continue
        out.append(arg)
    for flag, value in replaced.items():
        if value is not None:
            out += [flag, value]
    return out
