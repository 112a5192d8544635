"""The learning run: a real small model, the starter tasks, the whole fully-async loop.

SmolLM2-135M-Instruct (`riptide model fetch smollm2-135m`, or `--model FOLDER`), optionally
warm-started first (`--warm-start-steps N`: `riptide sft` on the oracle solutions of
tasks/starter/train, reported as its own figure), then trains with RL on tasks/starter/train
through the local stack (Redis, router, rollout with a built-in engine, sandbox with local
sandboxes, trainer), the markdown-bash protocol, evaluation of tasks/starter/heldout during
training every `--eval-interval` weight versions. Before and after RL, `riptide eval` scores the
held-out tasks greedily with the RL run's initial weights (the warm-started ones, if any) and
with its last checkpoint: same tasks, same settings, same engine. The baseline is the RL run's
initial model; `rl_from` says which it is.

On CPU the engine and the trainer compute in bfloat16 where the processor has bf16 matrix
units (several times faster than fp32 there) and in float32 where it has none (bf16 matmuls
then run about fifty times slower than fp32): `--dtype auto`; Adam keeps fp32 master weights.
The trainer scores each group's shared prompt once per micro-batch (`trainer.shared_prefix`,
packed rows; `--no-shared-prefix` for whole rows), recomputes each layer's activations in the
backward (`--recompute`) and checkpoints every 5 steps. Tasks are drawn by the chance that their
next group has reward variance (`--task-sampling informative`).

While it runs it prints (to stderr) the line `riptide up` prints for each trainer step and
each finished evaluation. The trainer stops itself after `--steps`; when the budget runs out
first, the stop lets it finish the step it is in. Either way the figures are counted after the
stop from what the run saved: `steps` (and `per_step_reward`) from its trainer.step events,
`checkpoint_step` from its checkpoints, the one the final eval scores; the two are equal.

Usage: python bench/learning.py [--steps 40] [--budget-min 30] [--warm-start-steps 0]
Last line: {"steps": n, "checkpoint_step": n, "per_step_reward": [...], "heldout_initial": x,
            "heldout_final": y,
            "eval_by_weight_version": {...}, "warm_start": {...} | null, "wall_s": ...}
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from services.common.checkpoint_steps import latest_checkpoint_step
from services.common.config import dump_config
from services.common.events import Event, load_events
from services.common.progress import StepProgress, cache_hit_rate
from services.local_stack import LocalStack, local_config, trainer_finished

REPO = Path(__file__).resolve().parents[1]
STARTER = REPO / "tasks" / "starter"
AGENT = {"protocol": "markdown_bash", "max_turns": 3, "max_new_tokens": 64,
         "max_context_tokens": 2048, "wall_time_s": 300.0, "default_command_timeout_s": 10.0}


def _resolve_dtype(dtype: str) -> str:
    """`auto`: bfloat16 where oneDNN has bf16 kernels for this processor, else float32."""
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def _eval(checkpoint: Path, base: Path | None, work: Path, dtype: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "services.cli", "eval", "--tasks", str(STARTER / "heldout"),
           "--checkpoint", str(checkpoint), "--greedy", "--dir", str(work),
           "--engine-dtype", dtype, "--concurrency", "5",
           "--protocol", AGENT["protocol"], "--max-turns", str(AGENT["max_turns"]),
           "--max-new-tokens", str(AGENT["max_new_tokens"]),
           "--max-context-tokens", str(AGENT["max_context_tokens"])]
    if base is not None:
        cmd += ["--base", str(base)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _warm_start(model: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`riptide sft` on the training tasks' oracle solutions; its JSON (with `hf`, the folder)."""
    cmd = [sys.executable, "-m", "services.cli", "sft", "--tasks", str(STARTER / "train"),
           "--model", str(model), "--protocol", AGENT["protocol"], "--out", str(out),
           "--steps", str(args.warm_start_steps), "--batch-size", "4",
           "--lr", str(args.warm_start_lr), "--dtype", args.dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"riptide sft failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _tasks_dir(run_dir: Path) -> Path:
    """Both splits in one folder for the sandbox service (held-out ones are never trained)."""
    folder = run_dir / "tasks"
    folder.mkdir(parents=True, exist_ok=True)
    for task in sorted(STARTER.glob("*/*/task.toml")):
        link = folder / task.parent.name
        if not link.exists():
            link.symlink_to(task.parent)
    return folder


def _config(run_dir: Path, model: Path, args: argparse.Namespace) -> Any:
    train = sorted(p.parent.name for p in (STARTER / "train").glob("*/task.toml"))
    heldout = sorted(p.parent.name for p in (STARTER / "heldout").glob("*/task.toml"))
    return local_config(run_dir, {
        "rollout": {"task_ids": train, "scheduler": {
            "max_concurrent_samples": args.in_flight, "n_samples_per_prompt": args.group_size,
            "num_groups_per_batch": args.groups_per_step, "max_new_tokens": AGENT["max_new_tokens"],
            "temperature": 0.8, "max_staleness": 2, "drop_zero_variance_groups": True,
            "zero_variance_cooldown_passes": args.cooldown_passes,
            "task_sampling": args.task_sampling},
            "fleet": {"model_path": str(model), "start_timeout_s": 600.0,
                      "builtin_args": ["--num-threads", str(args.engine_threads),
                                       "--dtype", args.dtype]},
            "eval": {"interval_steps": args.eval_interval, "task_ids": heldout,
                     "greedy": True}},
        "sandbox": {"tasks_dir": str(_tasks_dir(run_dir)), "tokenizer_path": str(model),
                    "max_concurrent_episodes": args.in_flight, "agent": AGENT},
        "trainer": {"rollout_batch_size": args.groups_per_step,
                    "checkpoint": {"interval_steps": args.checkpoint_interval},
                    "max_tokens_per_microbatch": args.microbatch_tokens,
                    "packed_sequences": args.shared_prefix, "shared_prefix": args.shared_prefix,
                    "model": {"hf_path": str(model), "dtype": args.dtype, **(
                        {"recompute_granularity": "full", "recompute_method": "uniform",
                         "recompute_num_layers": 1} if args.recompute else {})},
                    "optimizer": {"lr": args.lr, "stream_optimizer_state_to_disk": (
                        str(run_dir / "adam-state") if args.optimizer_on_disk else None)},
                    "weight_sync": {"dtype": args.dtype}},
    })


def _details(config: Any, name: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {config.run.admin_token}"}
    try:
        reply = httpx.get(f"{getattr(config, name).admin_url}/admin/state", headers=headers,
                          timeout=5)
        return dict(reply.json().get("details") or {})
    except (httpx.HTTPError, ValueError):
        return {}


def _rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its children (the trainer's ranks), in MB."""
    try:
        out = subprocess.run(["ps", "-o", "rss=", "--ppid", str(pid), "-p", str(pid)],
                             capture_output=True, text=True, check=False).stdout
    except OSError:
        return 0.0
    return sum(int(v) for v in out.split()) / 1024


def _cache_hit_rate(events: list[Event]) -> float | None:
    """The run's prefix-cache hit rate, from its last load snapshot."""
    loads = [e for e in events if e.kind == "rollout.load"]
    rate = cache_hit_rate(loads[-1]) if loads else None
    return None if rate is None else round(rate, 3)


def trained_steps(events: list[Event]) -> dict[int, dict[str, Any]]:
    """Each trained step's figures, from the saved events: the steps the trainer trained,
    including one it finished on the way out when the budget ran out (a step retrained after
    a crash counts once, with its last figures)."""
    return {int(e.attrs["step"]): e.attrs for e in events if e.kind == "trainer.step"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--budget-min", type=float, default=30.0, help="wall time of the run")
    parser.add_argument("--model", type=Path, default=None, help="default: smollm2-135m")
    parser.add_argument("--dir", type=Path, default=REPO / ".riptide" / "learn")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=1)
    parser.add_argument("--in-flight", type=int, default=16,
                        help="episodes in flight: two groups decode as one batch")
    parser.add_argument("--task-sampling", default="informative",
                        choices=("informative", "cycle"),
                        help="informative: tasks drawn by the chance that a group of them has "
                        "reward variance; cycle: shuffled passes with a cooldown")
    parser.add_argument("--cooldown-passes", type=int, default=2,
                        help="cycle: passes a task sits out after a zero-variance group")
    parser.add_argument("--engine-threads", type=int, default=2)
    parser.add_argument("--microbatch-tokens", type=int, default=2048,
                        help="trainer micro-batch size: 2048 holds a group's shared prompt and "
                        "its 8 continuations")
    parser.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=True,
                        help="packed rows, each group's prompt scored once (trainer.shared_prefix)")
    parser.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                        help="recompute each layer's activations in the backward (the trainer "
                        "idles while the engine generates; this keeps it under 3 GB)")
    parser.add_argument("--optimizer-on-disk", action=argparse.BooleanOptionalAction,
                        default=True, help="Adam's fp32 state in files under the run dir")
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--checkpoint-interval", type=int, default=5,
                        help="trainer steps between checkpoints (the last step is always "
                        "checkpointed when the run stops; the final eval scores it)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="engine and trainer compute dtype (auto: bfloat16 where the CPU "
                        "has bf16 kernels, else float32)")
    parser.add_argument("--warm-start-steps", type=int, default=0,
                        help="riptide sft steps (4 trajectories each) before RL; 0 (the "
                        "default): RL from the raw model")
    parser.add_argument("--warm-start-lr", type=float, default=3e-5)
    args = parser.parse_args()
    args.dtype = _resolve_dtype(args.dtype)
    started = time.monotonic()
    if args.model is None:
        from services.common.model_fetch import fetch_model

        args.model = fetch_model("smollm2-135m", Path.home() / ".cache" / "riptide" / "models")
    run_dir = args.dir
    if run_dir.exists():  # a fresh run each time: a stale checkpoint would be resumed
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    warm: dict[str, Any] | None = None
    rl_from = "raw model (no warm start)"
    if args.warm_start_steps:
        warm = _warm_start(args.model, run_dir / "sft", args)
        args.model = run_dir / "sft" / "hf"
        rl_from = f"warm start: riptide sft, {args.warm_start_steps} steps"
    print(f"[learn] held-out eval of the initial weights ({args.model})", file=sys.stderr,
          flush=True)
    initial = _eval(args.model, None, run_dir / "eval-initial", args.dtype)
    rl_started = time.monotonic()
    deadline = rl_started + args.budget_min * 60
    config = _config(run_dir, args.model, args)
    path = run_dir / "config.toml"
    path.write_text(dump_config(config))
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    # The trainer stops itself after --steps; a stop at the budget lets it finish its step.
    stack = LocalStack(run_dir, path, say=say, max_steps=args.steps)
    progress = StepProgress(config.redis.url, config.run.name, args.steps)
    trainer_rss_mb = 0.0
    try:
        stack.start(ready_timeout_s=900)
        while not trainer_finished(config, args.steps) and time.monotonic() < deadline:
            stack.check_children()  # restarts a dead service; raises when one keeps dying
            child = stack.children.get("trainer")
            if child is not None:
                trainer_rss_mb = max(trainer_rss_mb, _rss_mb(child.pid))
            for line in progress.poll():  # the lines `riptide up` prints, steps and evals
                say(line)
            time.sleep(1.0)
        rollout = _details(config, "rollout").get("scheduler", {})
        trainer = _details(config, "trainer")
    finally:
        stack.stop()
        for line in progress.poll():
            say(line)
        progress.close()
    rl_wall_s = time.monotonic() - rl_started
    # Counted after the stop, from what the run saved: the steps trained and the checkpoints.
    events = load_events(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    steps = trained_steps(events)
    checkpoint_step = latest_checkpoint_step(run_dir / "checkpoints")
    final = (_eval(run_dir / "checkpoints" / f"step-{checkpoint_step:08d}", args.model,
                   run_dir / "eval-final", args.dtype) if checkpoint_step else {})
    last_step = steps[max(steps)] if steps else {}
    print(json.dumps({
        "model": str(args.model), "rl_from": rl_from, "dtype": args.dtype,
        "shared_prefix": args.shared_prefix,
        "steps": max(steps, default=0), "checkpoint_step": checkpoint_step,
        "groups_trained": sum(int(a.get("groups") or 0) for a in steps.values()),
        "per_step_reward": [round(float(steps[k]["reward_mean"]), 4) for k in sorted(steps)],
        "heldout_initial": initial["mean_success"],
        "heldout_final": final.get("mean_success"),
        "eval_by_weight_version": {v: e.get("mean_success")
                                   for v, e in (rollout.get("eval") or {}).items()},
        "groups_dropped": rollout.get("dropped_groups"),
        "mismatch_kl_last_step": last_step.get("mismatch_kl"),
        "trainer_idle_fraction": round(trainer.get("total_wait_s", 0.0) / rl_wall_s, 3),
        "trainer_peak_rss_mb": round(trainer_rss_mb),
        "cache_hit_rate": _cache_hit_rate(events),
        "task_sampler_at_end": rollout.get("task_sampler"),
        "heldout_initial_tasks": {t: r["success"] for t, r in initial["tasks"].items()},
        "heldout_final_tasks": {t: r["success"] for t, r in (final.get("tasks") or {}).items()},
        "warm_start": None if warm is None else {
            "steps": warm.get("steps"), "losses": warm.get("losses"),
            "wall_s": warm.get("wall_s")},
        "rl_wall_s": round(rl_wall_s, 1), "wall_s": round(time.monotonic() - started, 1)}))


if __name__ == "__main__":
    main()
