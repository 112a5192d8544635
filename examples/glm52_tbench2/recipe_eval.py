"""The recipe's eval parts: the eval task set, the checkpoint to score, the score deployment.

Used by run_glm5_2_744b_a40b_daytona.py for eval during training (`[rollout.eval]` from
--eval-tasks, --eval-samples, --eval-interval) and for its `eval` subcommand, which turns the
training deployment into Riptide's score mode (services/rollout/scoring.py): engines serving
the checkpoint on every node, router, sandbox and the rollout, no trainer and no Redis.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError

#: Eval during training (and the default task set `eval` scores): the reference's 20 tasks
#: held out of --tasks-dir (a seeded draw, the same in both), 2 samples at temperature 0.8.
EVAL_INTERVAL, EVAL_TASKS, EVAL_SAMPLES, EVAL_TEMPERATURE = 10, "20", 2, 0.8
SMOKE_EVAL_INTERVAL, SMOKE_EVAL_TASKS = 2, "2"


def eval_section(args: argparse.Namespace) -> dict[str, Any]:
    """[rollout.eval] from --eval-tasks, --eval-samples and (train) --eval-interval."""
    spec = args.eval_tasks
    section: dict[str, Any] = {"num_samples": args.eval_samples, "greedy": False,
                               "temperature": EVAL_TEMPERATURE, "seed": 0}
    if args.eval_samples < 1:
        raise ConfigError(f"--eval-samples {args.eval_samples}: at least 1 episode a task")
    if spec == "all":
        if args.command != "eval":
            raise ConfigError("--eval-tasks all holds out every task, leaving none to train "
                              "on: give a number of tasks or their names")
        return section
    if spec.isdigit():
        section["num_tasks"] = int(spec)
    else:
        section["task_ids"] = [t for t in spec.split(",") if t]
    held_out = bool(section.get("num_tasks") or section.get("task_ids"))
    if args.command == "eval":
        if not held_out:
            raise ConfigError(f"--eval-tasks {spec}: no task to score (give N, names or all)")
        return section
    if args.eval_interval < 0:
        raise ConfigError(f"--eval-interval {args.eval_interval}: weight versions between "
                          "evals, 0 or more (0: no eval)")
    if args.eval_interval and not held_out:
        raise ConfigError(f"--eval-tasks {spec} holds out no task, so --eval-interval "
                          f"{args.eval_interval} evaluates nothing: pass --eval-interval 0 "
                          "to train without eval")
    section["interval_steps"] = args.eval_interval if held_out else 0
    return section


def check_eval_tasks(args: argparse.Namespace) -> None:
    """The eval task set fits --tasks-dir (and leaves tasks to train on)."""
    names = {p.parent.name for p in args.tasks_dir.glob("*/task.toml")}
    spec = args.eval_tasks or EVAL_TASKS  # build() fills it in; the default before that
    if spec == "all":
        return
    if spec.isdigit():
        limit = len(names) if args.command == "eval" else len(names) - 1
        if int(spec) > limit:
            raise ConfigError(f"--eval-tasks {spec}: {args.tasks_dir} holds {len(names)} "
                              f"tasks; at most {limit} can be held out"
                              + ("" if args.command == "eval" else " (one is left to train)"))
        return
    missing = sorted(set(spec.split(",")) - names - {""})
    if missing:
        raise ConfigError(f"--eval-tasks: {args.tasks_dir} has no task "
                          f"{', '.join(missing[:5])}")


def resolve_checkpoint(args: argparse.Namespace) -> None:
    """From --checkpoint: what the engines serve (args.served_model: the folder itself, or
    its export) and the weight version the result is filed under (step-<n>: n, else 0)."""
    if args.checkpoint is None:
        raise ConfigError("eval needs --checkpoint: a Hugging Face model folder (e.g. "
                          "--fp8-model-dir to score the initial model) or a one-rank trainer "
                          "checkpoint step-<n>")
    args.checkpoint = args.checkpoint.resolve()
    name = args.checkpoint.name
    args.checkpoint_step = int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else 0
    hf_folder = (args.checkpoint / "config.json").is_file() or not args.checkpoint.exists()
    args.served_model = args.checkpoint if hf_folder else eval_dir(args) / "model"


def eval_dir(args: argparse.Namespace) -> Path:
    """Where one checkpoint's eval lives: its config, logs, export and result.json."""
    return args.output_dir.resolve() / "eval" / args.checkpoint.name


def check_checkpoint(args: argparse.Namespace) -> None:
    """--checkpoint is a model folder, or a trainer checkpoint with its base at --model-dir."""
    ckpt = args.checkpoint
    if (ckpt / "config.json").is_file():
        return
    if not ckpt.is_dir():
        raise ConfigError(f"--checkpoint {ckpt}: no such folder")
    if not (args.model_dir / "config.json").is_file():
        raise ConfigError(f"--checkpoint {ckpt} is a trainer checkpoint (no config.json): "
                          f"--model-dir {args.model_dir} must be the model it was trained from")


def score_deployment(config: dict[str, Any], args: argparse.Namespace) -> None:
    """The eval deployment: the rollout in its score mode over engines that serve the
    checkpoint at its step's weight version; no trainer, no Redis."""
    served, version = args.served_model, args.checkpoint_step
    work = eval_dir(args)
    config["run"]["name"] += "-eval"
    config["rollout"]["mode"] = "score"
    config["rollout"]["eval"]["result_path"] = str(work / "result.json")
    config["rollout"]["fleet"]["model_path"] = str(served)
    config["rollout"]["weight_update"]["initial_weight_version"] = version
    if "engine" in config:
        config["engine"]["model_path"] = str(served)
    del config["trainer"]
    config["slurm"]["log_dir"] = str(work / "logs")


def eval_plan(config: Any, args: argparse.Namespace) -> list[str]:
    """What is evaluated, on which tasks, and where the result goes."""
    ev = config.rollout.eval
    tasks = (", ".join(ev.task_ids) if ev.task_ids else
             f"{ev.num_tasks} tasks of {args.tasks_dir} held out of training (seeded draw, "
             f"seed {ev.seed})" if ev.num_tasks else f"every task of {args.tasks_dir}")
    sampling = "greedy" if ev.greedy else f"temperature {ev.temperature:g}"
    lines = ["## Eval"]
    if config.rollout.mode == "score":
        served = args.served_model
        how = ("served as is" if served == args.checkpoint and served.exists() else
               f"exported at launch to {served} (base {args.model_dir})" if served.exists()
               else "not here yet: a model folder is served as is, a trainer checkpoint "
                    "exported at launch")
        lines += [f"  scores {args.checkpoint} ({how}) at weight version "
                  f"{config.rollout.weight_update.initial_weight_version}: no trainer, no Redis",
                  f"  tasks: {tasks}; {ev.num_samples} samples a task, {sampling}",
                  f"  result (per-task and mean success, JSON): {ev.result_path}"]
    elif ev.interval_steps:
        lines += [f"  every {ev.interval_steps} weight versions and at the start: {tasks}; "
                  f"{ev.num_samples} samples a task, {sampling}; never trained on",
                  "  results: the rollout's /admin/state (eval) and the run summary"]
    else:
        lines.append("  none (--eval-interval 0)")
    return lines
