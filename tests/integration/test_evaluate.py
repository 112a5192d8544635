"""Task-folder evaluation: real local sandboxes, the task's own tests, any agent protocol;
`riptide eval` end to end with an engine it starts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.tiny_model import build_tokenizer
from services.sandbox.chat_format import ChatFormat
from services.sandbox.config import AgentConfig
from services.sandbox.evaluate import evaluate
from services.sandbox.model_client import ScriptedModelClient
from services.sandbox.protocol import PROTOCOL_TYPES
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.scripted_policy import scripted_turns
from services.sandbox.task import TaskSet

REPO = Path(__file__).resolve().parents[2]
HELDOUT = TaskSet.load(REPO / "tasks" / "starter" / "heldout")
CHAT = ChatFormat(build_tokenizer())


def _score(policy: str, protocol: str) -> dict[str, object]:
    agent = AgentConfig(protocol=protocol)  # type: ignore[arg-type]
    by_task = {t.name: scripted_turns(t, policy, 0, 30, agent) for t in HELDOUT}
    model = ScriptedModelClient(CHAT, lambda key: by_task[key.split("-", 1)[1].rsplit("-", 2)[0]])

    async def run() -> dict[str, object]:
        provider = LocalProvider(LocalProviderConfig())
        try:
            return await evaluate(HELDOUT, model, CHAT, provider, agent, num_samples=2,
                                  max_concurrent_episodes=8)
        finally:
            await provider.close()

    return asyncio.run(run())


@pytest.mark.parametrize("protocol", PROTOCOL_TYPES)
def test_the_oracle_scores_every_task_in_every_protocol(protocol: str) -> None:
    result = _score("oracle", protocol)
    assert result["num_tasks"] == len(HELDOUT) and result["no_verdict"] == 0
    assert result["mean_success"] == 1.0, result


def test_doing_nothing_scores_zero() -> None:
    result = _score("noop", "markdown_bash")
    tasks = result["tasks"]
    assert isinstance(tasks, dict)
    assert result["mean_success"] == 0.0 and len(tasks) == len(HELDOUT)
    assert all(entry["rewards"] == [0.0, 0.0] for entry in tasks.values())


def _riptide(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "eval", "--dir", str(tmp),
                           *args], capture_output=True, text=True, timeout=400, cwd=REPO)


@pytest.mark.slow
def test_riptide_eval_prints_per_task_and_mean_success(tmp_path: Path) -> None:
    result = _riptide("--tasks", str(REPO / "tasks" / "starter" / "heldout"), "--greedy",
                      "--max-turns", "1", "--max-new-tokens", "8", tmp=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["num_tasks"] == len(HELDOUT) and report["greedy"] is True
    assert set(report["tasks"]) == set(HELDOUT.names)
    assert report["mean_success"] == 0.0, "a random model solves nothing"


def test_riptide_eval_names_a_bad_folder(tmp_path: Path) -> None:
    result = _riptide("--tasks", str(tmp_path), tmp=tmp_path)
    assert result.returncode == 2 and "no task directories" in result.stderr


@pytest.mark.slow
def test_riptide_eval_run_scores_the_way_the_run_did(tmp_path: Path) -> None:
    """`--run DIR`: the run's held-out tasks, agent, sampling and engine arguments; a flag
    overrides one of them."""
    from services.common.config import dump_config
    from services.local_stack import ensure_tiny_model, local_config

    run = tmp_path / "run"
    ensure_tiny_model(run)
    config = local_config(run, {
        "rollout": {"eval": {"task_ids": ["last-line", "count-items"], "greedy": True},
                    "scheduler": {"max_new_tokens": 8},
                    "fleet": {"builtin_args": ["--dtype", "float32", "--num-threads", "1"]}},
        "sandbox": {"tasks_dir": str(REPO / "tasks" / "starter" / "heldout"),
                    "agent": {"max_turns": 2, "protocol": "markdown_bash"}}})
    (run / "config.toml").write_text(dump_config(config))
    result = _riptide("--run", str(run), "--max-turns", "1", "--also-sampled", "2",
                      tmp=tmp_path / "work")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["checkpoint"] == str(run / "model")  # no checkpoint yet: the run's model
    assert report["run"] == {"dir": str(run), "checkpoint_step": 0}
    assert set(report["tasks"]) == {"last-line", "count-items"} and report["greedy"] is True
    assert report["engine_args"] == ["--dtype", "float32", "--num-threads", "1"]
    assert (report["max_new_tokens"], report["max_turns"]) == (8, 1)
    assert report["protocol"] == "markdown_bash"
    # --also-sampled: a second pass on the same engine, 2 episodes a task at the temperature
    sampled = report["sampled"]
    assert (sampled["samples"], sampled["greedy"], sampled["temperature"]) == (2, False, 0.8)
    assert set(sampled["tasks"]) == {"last-line", "count-items"}
    assert all(len(task["rewards"]) == 2 for task in sampled["tasks"].values()), sampled
