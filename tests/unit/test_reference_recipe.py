"""The reference recipe: its defaults are the reference run, bad layouts fail before launch.

The table below is the reference page (GLM-5.2 x terminal-bench-2 on 16 nodes) row by row,
each row with the deployment setting that carries it; rows Riptide has no setting for must be
named in the plan's "Riptide lacks" list.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from services.common.errors import ConfigError
from services.slurm.memory import model_size
from services.slurm.steps import deployment_steps

RECIPE_DIR = Path(__file__).resolve().parents[2] / "examples" / "glm52_tbench2"


def load_recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "glm52_recipe", RECIPE_DIR / "run_glm5_2_744b_a40b_daytona.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe = load_recipe()


def build(*flags: str, command: str = "plan") -> Any:
    return recipe.build(recipe._parser().parse_args([command, *flags]))[0]


def _get(config: Any, path: str) -> Any:
    value = config
    for part in path.split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, part)
    return value


# (reference row, setting, expected value)
REFERENCE = [
    ("nodes: 8 trainer nodes", "slurm.trainer_nodes", [f"node{i:02d}" for i in range(8)]),
    ("nodes: 8 inference nodes", "slurm.engine_nodes", [f"node{i:02d}" for i in range(8, 16)]),
    ("4 GPUs a trainer node", "slurm.trainer_ranks_per_node", 4),
    ("TP 2", "trainer.parallel.tensor_parallel", 2),
    ("sequence parallel", "trainer.parallel.sequence_parallel", True),
    ("CP 4", "trainer.parallel.context_parallel", 4),
    ("PP 4", "trainer.parallel.pipeline_parallel", 4),
    ("layers split 18-20-20-20", "trainer.parallel.num_layers_per_stage", [18, 20, 20, 20]),
    ("EP 8", "trainer.parallel.expert_parallel", 8),
    ("DP 1", "trainer.parallel.data_parallel", 1),
    ("at most 8192 tokens per GPU", "trainer.max_tokens_per_microbatch", 8192),
    ("Adam lr 1e-6", "trainer.optimizer.lr", 1e-6),
    ("weight decay 0.1", "trainer.optimizer.weight_decay", 0.1),
    ("beta1 0.9", "trainer.optimizer.beta1", 0.9),
    ("beta2 0.98", "trainer.optimizer.beta2", 0.98),
    ("grad clip 1.0", "trainer.optimizer.max_grad_norm", 1.0),
    ("optimizer state on node-local disk", "trainer.optimizer.stream_optimizer_state_to_disk",
     "/local/riptide-optimizer"),
    ("buckets of at most 200M elements", "trainer.optimizer.bucket_mb", 200e6 * 4 / 2**20),
    ("moments fp32", "trainer.optimizer.moments_dtype", "float32"),
    ("eps clip low 0.2", "trainer.loss.clip_eps_low", 0.2),
    ("eps clip high 0.28", "trainer.loss.clip_eps_high", 0.28),
    ("TIS clip 2.0", "trainer.loss.tis_cap", 2.0),
    ("no KL", "trainer.loss.kl_coef", 0.0),
    ("weight buckets of 2 GiB", "trainer.weight_sync.bucket_mb", 2048.0),
    ("8 prompts", "rollout.scheduler.num_groups_per_batch", 8),
    ("8 prompts a step", "trainer.rollout_batch_size", 8),
    ("8 samples a prompt", "rollout.scheduler.n_samples_per_prompt", 8),
    ("100 steps", "trainer.max_steps", 100),
    ("128 samples in flight", "rollout.scheduler.max_concurrent_samples", 128),
    ("submission per sample", "rollout.scheduler.granularity", "sample"),
    ("temperature 0.8", "rollout.scheduler.temperature", 0.8),
    ("8192 new tokens a turn", "rollout.scheduler.max_new_tokens", 8192),
    ("8192 new tokens a turn (agent)", "sandbox.agent.max_new_tokens", 8192),
    ("65536 tokens a session", "sandbox.agent.max_context_tokens", 65536),
    ("30 turns", "sandbox.agent.max_turns", 30),
    ("3600 s an episode", "sandbox.agent.wall_time_s", 3600.0),
    ("command timeout 900 s", "sandbox.agent.max_command_timeout_s", 900.0),
    ("observation cut to 4000 characters", "sandbox.agent.max_observation_chars", 4000),
    ("pause mode in_place", "rollout.weight_update.pause_mode", "in_place"),
    ("4 GPUs an engine", "rollout.fleet.sglang.tp_size", 4),
    ("expert parallel 4", "rollout.fleet.sglang.ep_size", 4),
    ("DP attention", "rollout.fleet.sglang.enable_dp_attention", True),
    ("dp 4", "rollout.fleet.sglang.dp_size", 4),
    ("mem-fraction-static 0.85", "rollout.fleet.sglang.mem_fraction_static", 0.85),
    ("KV cache fp8 e4m3", "rollout.fleet.sglang.kv_cache_dtype", "fp8_e4m3"),
    ("page size 64", "rollout.fleet.sglang.page_size", 64),
    ("max running requests 256", "rollout.fleet.sglang.max_running_requests", 256),
    ("chunked prefill 32768", "rollout.fleet.sglang.chunked_prefill_size", 32768),
    ("cuda graphs up to batch 32", "rollout.fleet.sglang.cuda_graph_max_bs", 32),
    ("FP8 checkpoint for rollout", "rollout.fleet.sglang.quantization", "fp8"),
    ("FP8 checkpoint path", "rollout.fleet.model_path", "/models/glm-5.2-fp8"),
    ("one engine per inference node", "slurm.nodes_per_engine", 1),
    ("sticky per session, least-loaded new", "router.policy", "sticky_min_load"),
    ("Daytona sandboxes", "sandbox.provider.type", "daytona"),
    ("quota for 128 sandboxes", "sandbox.max_concurrent_episodes", 128),
    ("at most 8 concurrent creates", "sandbox.max_concurrent_creates", 8),
    ("8 create retries", "sandbox.provider.num_create_retries", 8),
    ("create timeout 1800 s", "sandbox.provider.create_timeout_s", 1800.0),
    ("auto-stop after 30 min idle", "sandbox.provider.auto_stop_interval_min", 30),
    ("auto-delete 120 min later", "sandbox.provider.auto_delete_interval_min", 120),
    ("one snapshot per task image", "sandbox.provider.use_snapshots", True),
    ("full activation recompute", "trainer.model.recompute_granularity", "full"),
    ("recompute method uniform", "trainer.model.recompute_method", "uniform"),
    ("recompute 1 layer per group", "trainer.model.recompute_num_layers", 1),
    ("eval every 10 steps", "rollout.eval.interval_steps", 10),
    ("eval on a disjoint task set (20 tasks)", "rollout.eval.num_tasks", 20),
    ("eval: 2 samples a task", "rollout.eval.num_samples", 2),
    ("eval at temperature 0.8", "rollout.eval.temperature", 0.8),
    ("eval samples, not greedy", "rollout.eval.greedy", False),
]
#: Rows with no Riptide setting: each must be named in the plan.
LACKING = ["per-pipeline-stage weight-update groups", "staging buffer", "end-only checkpoints",
           "resource floors", "ready timeout", "keepalive"]


@pytest.mark.parametrize(("row", "setting", "expected"), REFERENCE, ids=[r[0] for r in REFERENCE])
def test_default_plan_is_the_reference_row_by_row(row: str, setting: str, expected: Any) -> None:
    assert _get(DEFAULT, setting) == expected, row


DEFAULT = build()


def test_reference_speculative_decoding_and_low_latency_shape() -> None:
    args = DEFAULT.rollout.fleet.sglang.extra_args
    assert args[args.index("--speculative-num-steps") + 1] == "1"
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "2"
    low = build("--sglang-config", "low-latency")
    assert low.rollout.fleet.sglang.tp_size == 8 and low.slurm.nodes_per_engine == 2
    assert low.rollout.fleet.sglang.max_running_requests == 512
    assert len(low.rollout.fleet.attach_urls) == 4  # node pairs


def test_plan_prints_steps_config_memory_and_what_riptide_lacks() -> None:
    result = subprocess.run([sys.executable, str(RECIPE_DIR / "run_glm5_2_744b_a40b_daytona.py"),
                             "plan"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "node00: redis, router, sandbox, rollout, trainer x4" in text
    assert "node08: engine-0" in text and "sglang.launch_server" in text
    assert "--ntasks=32" in text and "MASTER_ADDR=node00" in text
    assert "[trainer.parallel]" in text and "<admin token>" in text
    assert DEFAULT.run.admin_token not in text
    for what in ("weights", "gradients", "optimizer state (on local disk)",
                 "activations, full recompute", "KV tokens per GPU"):
        assert what in text
    for name in LACKING:
        assert name in text, name


def test_the_trainer_accepts_the_reference_layout_on_its_32_ranks() -> None:
    from services.trainer.parallel.parallel import check_sizes
    from services.trainer.ranks import service_world_size

    ranks = len(DEFAULT.slurm.trainer_nodes) * DEFAULT.slurm.trainer_ranks_per_node
    assert service_world_size(DEFAULT.trainer) == ranks == 32
    assert check_sizes(DEFAULT.trainer.parallel, ranks) == 1


def test_memory_estimate_counts_the_reference_model() -> None:
    size = model_size(recipe.GLM52)
    assert 730e9 < size.total < 760e9  # 744B
    assert 38e9 < size.active < 43e9  # A40B


@pytest.mark.parametrize(("flags", "message"), [
    (["--num-nodes", "9"], "needs at least 10"),
    (["--num-nodes", "11"], r"\(11 - 8\) x 4 = 12: must be a positive multiple of 8"),
    (["--num-nodes", "10", "--gpus-per-node", "8"], "uses 4 GPUs an engine over 1 node"),
    (["--num-nodes", "12", "--gpus-per-node", "8", "--sglang-config", "low-latency"],
     "uses 8 GPUs an engine over 2 node"),
    (["--tp", "3"], "--tp 3 does not divide the 64 attention heads"),
    (["--ep", "7"], "--ep 7 does not divide the 256 routed experts"),
    (["--cp", "3"], "= 24 does not divide the 32 trainer GPUs"),
    (["--cp", "2", "--ep", "16"], "--ep 16 does not divide TP 2 x CP 2 x DP 2"),
    (["--pipeline-split", "18,20,20,19"], "sums to 77 layers; the model has 78"),
    (["--pipeline-split", "26,26,26"], "has 3 stages, --pp is 4"),
    (["--nodes", "a,b,c", "--num-nodes", "16"], "--num-nodes 16 but the job has 3 nodes"),
])
def test_invalid_layouts_fail_with_their_message(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(*flags)


def _ready_files(tmp_path: Path) -> list[str]:
    key = tmp_path / "key"
    key.write_text("secret")
    key.chmod(0o600)
    tasks = tmp_path / "tasks" / "t1"
    tasks.mkdir(parents=True)
    (tasks / "task.toml").write_text("")
    for name in ("bf16", "fp8"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    return ["--daytona-key-file", str(key), "--tasks-dir", str(tmp_path / "tasks"),
            "--model-dir", str(tmp_path / "bf16"), "--fp8-model-dir", str(tmp_path / "fp8"),
            "--output-dir", str(tmp_path / "out")]


def _check_files(flags: list[str]) -> None:
    # The fixture's task folder is small: no held-out set unless a test asks for one.
    args = recipe._parser().parse_args(["train", "--dry-run", "--eval-tasks", "0",
                                        "--eval-interval", "0", *flags])
    recipe.check_files(args)


def test_launch_files_are_checked(tmp_path: Path) -> None:
    flags = _ready_files(tmp_path)
    _check_files(flags)
    (tmp_path / "key").chmod(0o644)
    with pytest.raises(ConfigError, match="is readable by others; chmod 600"):
        _check_files(flags)
    with pytest.raises(ConfigError, match="Daytona API key file .* does not exist"):
        _check_files([*flags, "--daytona-key-file", str(tmp_path / "nokey")])
    (tmp_path / "key").chmod(0o600)
    with pytest.raises(ConfigError, match="task directory .* is missing"):
        _check_files([*flags, "--tasks-dir", str(tmp_path / "none")])
    (tmp_path / "fp8" / "config.json").unlink()
    with pytest.raises(ConfigError, match="--fp8-model-dir .*: no model there"):
        _check_files(flags)
    (tmp_path / "fp8" / "config.json").write_text("{}")
    (tmp_path / "out" / "checkpoints" / "step-1").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds a previous run's state: pass --resume"):
        _check_files(flags)
    _check_files([*flags, "--resume"])
    shutil.rmtree(tmp_path / "out" / "checkpoints")
    (tmp_path / "out" / "redis" / "appendonlydir").mkdir(parents=True)
    with pytest.raises(ConfigError, match="redis holds a previous run's state"):
        _check_files(flags)


def test_smoke_plan_runs_on_one_node(tmp_path: Path) -> None:
    config = build("--smoke", "--head-address", "127.0.0.1", "--output-dir", str(tmp_path))
    steps = deployment_steps(config, tmp_path / "deploy.toml")
    assert [s.name for s in steps] == ["redis", "engine-0", "router", "sandbox", "rollout",
                                       "trainer"]
    assert all(s.nodes == ["node00"] for s in steps)
    assert config.sandbox.provider.type == "local" and config.slurm.engine_program == "builtin"
    assert config.rollout.fleet.attach_urls == ["http://127.0.0.1:30000"]
    assert config.engine.model_path == str(tmp_path / "model")
    # It runs: tests/e2e/test_slurm_deployment.py submits it to a real Slurm cluster.


def test_slurm_adapter_is_valid_bash_and_short() -> None:
    script = RECIPE_DIR / "launch_16node_slurm.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert len(script.read_text().splitlines()) <= 70


def test_eval_during_training_flags_fill_rollout_eval() -> None:
    config = build("--eval-interval", "5", "--eval-tasks", "a,b", "--eval-samples", "3")
    ev = config.rollout.eval
    assert (ev.interval_steps, ev.task_ids, ev.num_tasks, ev.num_samples) == (5, ["a", "b"], 0, 3)
    assert build("--eval-tasks", "0", "--eval-interval", "0").rollout.eval.interval_steps == 0
    assert config.rollout.mode == "train"


def test_eval_plan_scores_the_checkpoint_on_every_node_without_trainer(tmp_path: Path) -> None:
    config = build("--checkpoint", "/ckpt/step-40", "--num-nodes", "8",
                   "--output-dir", str(tmp_path), command="eval")
    assert config.rollout.mode == "score" and config.run.name == "glm52-tbench2-eval"
    assert config.rollout.eval.result_path == str(tmp_path / "eval" / "step-40" / "result.json")
    assert config.rollout.fleet.model_path == "/ckpt/step-40"
    assert config.rollout.weight_update.initial_weight_version == 40  # filed under step 40
    assert config.rollout.eval.num_tasks == 20 and config.rollout.eval.interval_steps == 0
    assert config.slurm.trainer_nodes == [] and len(config.rollout.fleet.attach_urls) == 8
    steps = deployment_steps(config, tmp_path / "deploy.toml")
    assert [s.name for s in steps] == [*(f"engine-{i}" for i in range(8)), "router", "sandbox",
                                       "rollout"]  # no Redis, no trainer
    assert "--weight-version 40" in " ".join(steps[0].command)
    result = subprocess.run([sys.executable, str(RECIPE_DIR / "run_glm5_2_744b_a40b_daytona.py"),
                             "eval", "--checkpoint", "/ckpt/step-40", "--num-nodes", "8",
                             "--output-dir", str(tmp_path), "--dry-run"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "node00: engine-0, router, sandbox, rollout" in text and "trainer" not in text.split(
        "## Deployment config")[0]
    assert 'mode = "score"' in text and "engine GPU:" in text and "trainer rank:" not in text
    assert f"result (per-task and mean success, JSON): {tmp_path}" in text


@pytest.mark.parametrize(("command", "flags", "message"), [
    ("eval", ["--num-nodes", "8"], "eval needs --checkpoint: a Hugging Face model folder"),
    ("eval", ["--checkpoint", "c", "--resume"], "eval has nothing to resume"),
    ("eval", ["--checkpoint", "c", "--eval-tasks", "0"], "--eval-tasks 0: no task to score"),
    ("eval", ["--checkpoint", "c", "--num-nodes", "3", "--sglang-config", "low-latency",
              "--gpus-per-node", "4"], "spans 2 nodes; 3 inference nodes do not split so"),
    ("train", ["--eval-tasks", "all"], "--eval-tasks all holds out every task, leaving none"),
    ("train", ["--eval-tasks", "0"], "--eval-tasks 0 holds out no task, so --eval-interval 10"
                                     " evaluates nothing: pass --eval-interval 0"),
    ("plan", ["--eval-interval", "-1"], "--eval-interval -1: weight versions between evals"),
    ("plan", ["--eval-samples", "0"], "--eval-samples 0: at least 1 episode a task"),
])
def test_invalid_eval_combinations_fail_with_their_message(command: str, flags: list[str],
                                                           message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(*flags, command=command)


def test_eval_files_and_task_set_are_checked(tmp_path: Path) -> None:
    flags = _ready_files(tmp_path)
    tasks = tmp_path / "tasks"
    for name in ("t2", "t3"):
        (tasks / name).mkdir()
        (tasks / name / "task.toml").write_text("")
    with pytest.raises(ConfigError, match=r"--eval-tasks 3: .* holds 3 tasks; at most 2 can "
                                          r"be held out \(one is left to train\)"):
        _check_files([*flags, "--eval-tasks", "3"])
    with pytest.raises(ConfigError, match="--eval-tasks: .* has no task nope"):
        _check_files([*flags, "--eval-tasks", "t1,nope"])
    _check_files([*flags, "--eval-tasks", "t1,t2"])

    def check_eval(*extra: str) -> None:
        args = recipe._parser().parse_args(["eval", *flags, *extra])
        recipe.build(args)
        recipe.check_eval_files(args)

    check_eval("--checkpoint", str(tmp_path / "bf16"), "--eval-tasks", "3", "--num-nodes", "2")
    with pytest.raises(ConfigError, match="--checkpoint .*/none: no such folder"):
        check_eval("--checkpoint", str(tmp_path / "none"), "--eval-tasks", "1")
    trainer_ckpt = tmp_path / "out" / "checkpoints" / "step-2"
    trainer_ckpt.mkdir(parents=True)
    check_eval("--checkpoint", str(trainer_ckpt), "--eval-tasks", "all")
    with pytest.raises(ConfigError, match="is a trainer checkpoint .*--model-dir"):
        check_eval("--checkpoint", str(trainer_ckpt), "--model-dir", str(tmp_path / "none"),
                   "--eval-tasks", "all")
