"""The rollout's score mode: one evaluation of a task set, its per-task result, the task set
it draws, and the config that asks for it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.errors import ConfigError
from services.deployment import validate_config
from services.rollout.config import EvalConfig, RolloutConfig
from services.rollout.evaluation import EvalQueue, eval_task_ids
from services.rollout.scoring import score, write_result
from services.testing.virtual_clock import run_virtual


class Runner:
    """`solved` scores 1, `half` scores 1 on even samples, `broken` raises, others score 0;
    each episode takes 1 s, so concurrency shows in the clock."""

    def __init__(self) -> None:
        self.running = 0
        self.most_running = 0
        self.sampling: list[common_pb2.SamplingParams] = []

    async def run(self, request: sandbox_pb2.RunEpisodeRequest) -> common_pb2.Trajectory:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        self.sampling.append(request.sampling_params)
        try:
            await asyncio.sleep(1.0)
        finally:
            self.running -= 1
        if request.task_id == "broken":
            raise RuntimeError("sandbox create failed")
        reward = {"solved": 1.0, "half": float(request.sample_index % 2 == 0)}.get(
            request.task_id, 0.0)
        return common_pb2.Trajectory(reward=reward, status=common_pb2.VERDICT_STATUS_SCORED)


def test_one_evaluation_scores_every_task_with_bounded_concurrency() -> None:
    runner = Runner()
    config = EvalConfig(num_samples=2, greedy=False, temperature=0.8)
    queue = EvalQueue(config, max_new_tokens=16, top_p=1.0,
                      task_ids=["solved", "half", "none", "broken"])

    async def main() -> tuple[dict[str, object], float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        result = await score(queue, 7, runner, max_concurrent_episodes=3)
        return result, loop.time() - start

    result, took_s = run_virtual(main())
    assert runner.most_running == 3 and took_s == pytest.approx(3.0)  # 8 episodes, 3 at once
    assert result["weight_version"] == 7 and result["num_tasks"] == 4
    tasks = result["tasks"]
    assert isinstance(tasks, dict)
    assert {t: e["success"] for t, e in tasks.items()} == {
        "solved": 1.0, "half": 0.5, "none": 0.0, "broken": 0.0}
    assert tasks["broken"]["no_verdict"] == 2 and result["no_verdict"] == 2
    assert tasks["half"]["rewards"] == [1.0, 0.0]
    assert tasks["half"]["finish_reasons"] == ["scored", "scored"]
    assert tasks["broken"]["finish_reasons"] == ["no_verdict", "no_verdict"]
    assert result["mean_success"] == pytest.approx(1.5 / 4)
    assert result["done"] == result["expected"] == 8
    assert all(p.temperature == pytest.approx(0.8) for p in runner.sampling)
    assert len({p.sampling_seed for p in runner.sampling}) == 2  # one seed per sample index


def test_the_result_file_is_whole_json(tmp_path: Path) -> None:
    target = tmp_path / "eval" / "score.json"
    write_result(target, {"mean_success": 0.5, "tasks": {}})
    assert json.loads(target.read_text()) == {"mean_success": 0.5, "tasks": {}}
    assert [p.name for p in target.parent.iterdir()] == ["score.json"]


LISTED = [f"task-{i:02d}" for i in range(30)]


def test_the_held_out_draw_is_seeded_and_the_same_for_training_and_scoring() -> None:
    drawn = eval_task_ids(EvalConfig(num_tasks=20, seed=3), LISTED)
    assert len(set(drawn)) == 20 and set(drawn) <= set(LISTED)
    assert drawn == eval_task_ids(EvalConfig(num_tasks=20, seed=3), list(reversed(LISTED)),
                                  every_task=True)
    assert drawn != eval_task_ids(EvalConfig(num_tasks=20, seed=4), LISTED)
    assert eval_task_ids(EvalConfig(), LISTED) == []
    assert eval_task_ids(EvalConfig(), LISTED, every_task=True) == sorted(LISTED)
    assert eval_task_ids(EvalConfig(task_ids=["task-05"]), LISTED) == ["task-05"]


@pytest.mark.parametrize(("config", "message"), [
    (EvalConfig(num_tasks=31), "num_tasks = 31, but the sandbox lists only 30 tasks"),
    (EvalConfig(task_ids=["task-01", "nope"]), "the sandbox lists no task nope"),
])
def test_a_task_set_the_sandbox_lacks_is_named(config: EvalConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        eval_task_ids(config, LISTED)


def test_score_mode_needs_a_result_path_and_one_kind_of_task_set() -> None:
    with pytest.raises(ValueError, match="rollout.eval.result_path: set it"):
        RolloutConfig(mode="score")
    with pytest.raises(ValueError, match="name the held-out tasks or give their number"):
        EvalConfig(task_ids=["a"], num_tasks=2)
    run = {"name": "x", "admin_token": "t" * 16}
    with pytest.raises(ConfigError, match="rollout.mode"):
        validate_config({"run": run, "rollout": {"mode": "evaluate"}})
    config = validate_config({"run": run, "rollout": {
        "mode": "score", "eval": {"result_path": "out.json"}}})
    assert config.rollout.mode == "score"
