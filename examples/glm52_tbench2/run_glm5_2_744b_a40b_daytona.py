#!/usr/bin/env python3
"""GLM-5.2 744B-A40B learning terminal-bench-2 on Daytona: the reference run as a recipe.

`train --num-nodes 16` reproduces the reference run; every deviation is a flag. The recipe
only fills Riptide's own deployment config (services/deployment.py) and hands it to the
generic Slurm deployment (services/slurm), which runs one srun step per service:
  plan             print the whole deployment: processes per node, config, memory, gaps
  train            validate, write the config, run the steps (--dry-run: validate and plan)
  eval             score a checkpoint on a task set: router, sandbox, rollout in its score
                   mode and engines serving the checkpoint on every node, no trainer; the
                   result (per-task and mean success, JSON) lands in OUTPUT_DIR/eval/<name>/
Run it inside the Slurm job (launch_16node_slurm.sh does), on the first node of the job.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from examples.glm52_tbench2.recipe_eval import (  # noqa: E402
    EVAL_INTERVAL,
    EVAL_SAMPLES,
    EVAL_TASKS,
    SMOKE_EVAL_INTERVAL,
    SMOKE_EVAL_TASKS,
    check_checkpoint,
    check_eval_tasks,
    eval_dir,
    eval_plan,
    eval_section,
    resolve_checkpoint,
    score_deployment,
)
from services.common.config import dump_config  # noqa: E402
from services.common.errors import ConfigError, RiptideError  # noqa: E402
from services.deployment import validate_config  # noqa: E402

#: GLM-5.2's config.json keys that size the model (the reference page's model rows), used
#: when the model folder is not at hand (plans made away from the cluster).
GLM52 = {
    "model_type": "glm_moe_dsa", "num_hidden_layers": 78, "first_k_dense_replace": 3,
    "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "vocab_size": 154880, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "index_topk": 2048,
    "index_n_heads": 32, "index_head_dim": 128,
}
NUM_TRAINER_NODES = 8
#: Engine shapes (--sglang-config): the [rollout.fleet.sglang] flags and nodes per engine.
SGLANG_SHAPES: dict[str, dict[str, Any]] = {
    "balanced": {"nodes": 1, "gpus": 4, "sglang": {
        "tp_size": 4, "dp_size": 4, "ep_size": 4, "enable_dp_attention": True,
        "max_running_requests": 256}},
    "low-latency": {"nodes": 2, "gpus": 8, "sglang": {
        "tp_size": 8, "dp_size": 1, "ep_size": 1, "max_running_requests": 512}},
}
ENGINE_COMMON = {
    "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3", "mem_fraction_static": 0.85,
    "page_size": 64, "chunked_prefill_size": 32768, "cuda_graph_max_bs": 32,
    # The model's MTP layer drafts: 1 step, 2 draft tokens.
    "extra_args": ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1",
                   "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"],
}
#: Reference settings Riptide has no setting for yet: (reference row, the setting it needs).
RIPTIDE_LACKS = [
    ("one weight-update group per pipeline stage",
     "trainer.weight_sync per-pipeline-stage weight-update groups"),
    ("optimizer state staged through 256 MiB", "trainer.optimizer staging buffer size"),
    ("checkpoints only at the end of training",
     "end-only checkpoints (the trainer acks stream entries only after a checkpoint, so it "
     "checkpoints every trainer.checkpoint.interval_steps)"),
    ("sandbox resource floors 1 CPU / 2 GiB / 10 GiB",
     "sandbox.provider resource floors (fixed at 1 CPU / 1 GiB / 1 GiB)"),
    ("Daytona ready timeout 300 s", "sandbox.provider ready timeout"),
    ("Daytona keepalive every 300 s", "sandbox.provider keepalive interval"),
]
#: A bundled task set and a tiny model make --smoke run anywhere, even on one node.
SMOKE_TASKS = REPO / "tasks"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("plan", "train", "eval"):
        p = sub.add_parser(name)
        p.add_argument("--num-nodes", type=int, default=None, help="nodes of the job (16)")
        p.add_argument("--nodes", default=None,
                       help="comma-separated node names (default: the job's, or node00...)")
        p.add_argument("--head-address", default=None,
                       help="address of the first node that the others reach it at")
        p.add_argument("--gpus-per-node", type=int, default=4)
        p.add_argument("--gpu-memory-gb", type=float, default=277.0,
                       help="usable HBM of one GPU, for the memory plan")
        p.add_argument("--steps", type=int, default=None, help="trainer steps (100; smoke: 3)")
        p.add_argument("--smoke", action="store_true",
                       help="one node or more, a tiny model, the built-in engine, local "
                            "sandboxes on the bundled tasks, short episodes")
        p.add_argument("--sglang-config", choices=sorted(SGLANG_SHAPES), default="balanced")
        p.add_argument("--tp", type=int, default=2)
        p.add_argument("--pp", type=int, default=4)
        p.add_argument("--cp", type=int, default=4)
        p.add_argument("--ep", type=int, default=8)
        p.add_argument("--pipeline-split", default="18,20,20,20",
                       help="decoder layers per pipeline stage, first stage first")
        p.add_argument("--pause-mode", choices=("in_place", "retract", "abort"),
                       default="in_place", help="engines' pause during weight updates")
        p.add_argument("--output-dir", type=Path, default=Path("riptide-glm52"),
                       help="config, logs, Redis data and checkpoints (shared filesystem)")
        p.add_argument("--model-dir", type=Path, default=Path("/models/glm-5.2"),
                       help="the model in Hugging Face form for the trainer (bf16)")
        p.add_argument("--fp8-model-dir", type=Path, default=Path("/models/glm-5.2-fp8"),
                       help="the FP8 checkpoint the engines serve")
        p.add_argument("--tasks-dir", type=Path, default=Path("/data/terminal-bench-2"))
        p.add_argument("--eval-tasks", default=None, metavar="N|NAMES|all",
                       help=f"the eval task set: N tasks of --tasks-dir held out of training "
                            f"(a seeded draw; {EVAL_TASKS}, smoke: {SMOKE_EVAL_TASKS}), "
                            f"comma-separated task names, or (eval only) all")
        p.add_argument("--eval-samples", type=int, default=EVAL_SAMPLES,
                       help="episodes per eval task")
        if name != "eval":
            p.add_argument("--eval-interval", type=int, default=None,
                           help=f"weight versions between evals during training, and one "
                                f"at the start ({EVAL_INTERVAL}, smoke: "
                                f"{SMOKE_EVAL_INTERVAL}; 0: none)")
        p.add_argument("--checkpoint-dir", type=Path, default=None,
                       help="default: OUTPUT_DIR/checkpoints")
        p.add_argument("--optimizer-dir", type=Path, default=Path("/local/riptide-optimizer"),
                       help="node-local disk for the streamed optimizer state")
        p.add_argument("--resume", action="store_true",
                       help="continue from the checkpoints in the checkpoint dir")
        p.add_argument("--daytona-key-file", type=Path,
                       default=Path.home() / ".config" / "daytona" / "api_key")
        p.add_argument("--port-base", type=int, default=0,
                       help="move every port to PORT_BASE + k (0: Riptide's defaults)")
        p.add_argument("--srun-arg", action="append", default=[],
                       help="extra srun flag for every step (container, gres); repeatable")
        p.add_argument("--dry-run", action="store_true", help="validate and plan only")
        if name == "eval":
            p.add_argument("--checkpoint", type=Path, default=None,
                           help="what the engines serve: a Hugging Face model folder (e.g. "
                                "--fp8-model-dir for the initial model) or a one-rank trainer "
                                "checkpoint step-<n>, exported with --model-dir as its base "
                                "(smoke default: the smoke model)")
    return parser


def job_nodes(args: argparse.Namespace) -> list[str]:
    """Node names: --nodes, else the Slurm job's, else placeholders (plans away from Slurm)."""
    if args.nodes:
        nodes = [n for n in args.nodes.split(",") if n]
    elif os.environ.get("SLURM_JOB_NODELIST"):
        out = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                             capture_output=True, text=True, check=True)
        nodes = out.stdout.split()
    else:
        nodes = [f"node{i:02d}" for i in range(args.num_nodes or (1 if args.smoke else 16))]
    if args.num_nodes is not None and args.num_nodes != len(nodes):
        raise ConfigError(f"--num-nodes {args.num_nodes} but the job has {len(nodes)} nodes")
    return nodes


def check_engine_shape(args: argparse.Namespace, num_inference_nodes: int) -> None:
    """The engine shape fits a node's GPUs and the inference nodes split into engines."""
    shape = SGLANG_SHAPES[args.sglang_config]
    if args.smoke:  # the built-in engine: one a node, whatever the shape
        return
    if shape["gpus"] != shape["nodes"] * args.gpus_per_node:
        raise ConfigError(f"engine shape {args.sglang_config!r} uses {shape['gpus']} GPUs an "
                          f"engine over {shape['nodes']} node(s), but a node has "
                          f"{args.gpus_per_node} GPUs")
    if num_inference_nodes % shape["nodes"]:
        raise ConfigError(f"engine shape {args.sglang_config!r} spans {shape['nodes']} nodes; "
                          f"{num_inference_nodes} inference nodes do not split so")


def check_layout(args: argparse.Namespace, num_nodes: int, hf: dict[str, Any]) -> list[int]:
    """The node, engine and parallel checks; returns the pipeline split."""
    if num_nodes < NUM_TRAINER_NODES + 2:
        raise ConfigError(f"{num_nodes} nodes: the reference layout needs at least 10 "
                          f"({NUM_TRAINER_NODES} trainer nodes + at least 2 inference nodes)")
    inference_gpus = (num_nodes - NUM_TRAINER_NODES) * args.gpus_per_node
    if inference_gpus % 8:
        raise ConfigError(f"inference GPUs = ({num_nodes} - {NUM_TRAINER_NODES}) x "
                          f"{args.gpus_per_node} = {inference_gpus}: must be a positive "
                          "multiple of 8")
    check_engine_shape(args, num_nodes - NUM_TRAINER_NODES)
    split = [int(x) for x in args.pipeline_split.split(",")]
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    experts = hf.get("n_routed_experts") or hf.get("num_experts") or 0
    if len(split) != args.pp:
        raise ConfigError(f"--pipeline-split {args.pipeline_split} has {len(split)} stages, "
                          f"--pp is {args.pp}")
    if sum(split) != layers:
        raise ConfigError(f"--pipeline-split {args.pipeline_split} sums to {sum(split)} layers;"
                          f" the model has {layers}")
    if heads % args.tp:
        raise ConfigError(f"--tp {args.tp} does not divide the {heads} attention heads")
    if experts and experts % args.ep:
        raise ConfigError(f"--ep {args.ep} does not divide the {experts} routed experts")
    trainer_gpus = NUM_TRAINER_NODES * args.gpus_per_node
    if trainer_gpus % (args.tp * args.pp * args.cp):
        raise ConfigError(f"TP {args.tp} x PP {args.pp} x CP {args.cp} = "
                          f"{args.tp * args.pp * args.cp} does not divide the {trainer_gpus} "
                          "trainer GPUs")
    dp = trainer_gpus // (args.tp * args.pp * args.cp)
    if (args.tp * args.cp * dp) % args.ep:
        raise ConfigError(f"--ep {args.ep} does not divide TP {args.tp} x CP {args.cp} x DP {dp}"
                          " (expert TP is 1: expert ranks come from those)")
    return split


def check_files(args: argparse.Namespace) -> None:
    """Everything the run reads from disk is there, and the Daytona key is private."""
    check_key_file(args)
    check_task_files(args)
    for flag, path in (("--model-dir", args.model_dir), ("--fp8-model-dir", args.fp8_model_dir)):
        if not (path / "config.json").is_file():
            raise ConfigError(f"{flag} {path}: no model there (config.json missing)")
    for state in (_checkpoint_dir(args), args.output_dir.resolve() / "redis"):
        if state.is_dir() and any(state.iterdir()) and not args.resume:
            raise ConfigError(f"{state} holds a previous run's state: pass --resume to continue"
                              " from it, or choose another --output-dir")


def check_task_files(args: argparse.Namespace) -> None:
    """The task directory holds tasks, and the eval task set fits it."""
    if not (args.tasks_dir.is_dir() and any(args.tasks_dir.glob("*/task.toml"))):
        raise ConfigError(f"task directory {args.tasks_dir} is missing or holds no task "
                          "(a terminal-bench-2 checkout: <task>/task.toml)")
    check_eval_tasks(args)


def check_eval_files(args: argparse.Namespace) -> None:
    """eval's files: the Daytona key (unless --smoke), the tasks, the checkpoint to serve."""
    if not args.smoke:
        check_key_file(args)
    check_task_files(args)
    check_checkpoint(args)


def check_key_file(args: argparse.Namespace) -> None:
    """The Daytona API key file exists and only its owner can read it."""
    key = args.daytona_key_file
    if not key.is_file():
        raise ConfigError(f"Daytona API key file {key} does not exist (--daytona-key-file)")
    if key.stat().st_mode & 0o077:
        raise ConfigError(f"Daytona API key file {key} is readable by others; chmod 600 {key}")


def _checkpoint_dir(args: argparse.Namespace) -> Path:
    return (args.checkpoint_dir or args.output_dir / "checkpoints").resolve()


def _ports(base: int) -> dict[str, int]:
    defaults = {"redis": 6379, "router": 50051, "router_admin": 8051, "sandbox": 50053,
                "sandbox_admin": 8053, "rollout": 50052, "rollout_admin": 8052,
                "trainer": 50054, "trainer_admin": 8054, "engine": 30000, "trainer_master": 29500,
                "engine_dist": 30100}
    return {k: base + i if base else v for i, (k, v) in enumerate(defaults.items())}


def node_roles(args: argparse.Namespace, nodes: list[str]) -> tuple[list[str], list[str]]:
    """(trainer nodes, engine nodes). eval runs no trainer: engines on every node (the CPU
    services share the first one)."""
    if args.command == "eval":
        return [], list(nodes)
    if args.smoke:
        return nodes[:1], nodes[1:] or nodes[:1]
    return nodes[:NUM_TRAINER_NODES], nodes[NUM_TRAINER_NODES:]


def deployment(args: argparse.Namespace, nodes: list[str], admin_token: str) -> dict[str, Any]:
    """The deployment config of the reference run (or its smoke version) as a dict."""
    out = args.output_dir.resolve()
    head = args.head_address or nodes[0]
    ports = _ports(args.port_base)
    trainer_nodes, engine_nodes = node_roles(args, nodes)
    shape = SGLANG_SHAPES[args.sglang_config]
    nodes_per_engine = 1 if args.smoke else shape["nodes"]
    addr = {nodes[0]: head}
    urls = [f"http://{addr.get(n, n)}:{ports['engine']}" for n in engine_nodes[::nodes_per_engine]]
    bind = "127.0.0.1" if head.startswith("127.") else "0.0.0.0"
    listen = {"bind_host": bind}

    def service(name: str) -> dict[str, Any]:
        return {"host": head, **listen, "grpc_port": ports[name],
                "admin_port": ports[f"{name}_admin"]}

    config: dict[str, Any] = {
        "run": {"name": "glm52-tbench2-smoke" if args.smoke else "glm52-tbench2",
                "admin_token": admin_token, "grpc_token": secrets.token_urlsafe(24),
                "engine_api_key": secrets.token_urlsafe(24), "log_format": "json"},
        # The ACL user's password: written only to the 0600 deployment file (Redis gets its
        # hash in a 0600 redis.conf), never on a command line.
        "redis": {"url": f"redis://{head}:{ports['redis']}/0", "max_groups": 64,
                  "password": secrets.token_urlsafe(32)},
        "router": {**service("router"), "policy": "sticky_min_load",
                   "session_idle_s": 1000.0},  # longer than the longest command (900 s)
        "sandbox": {**service("sandbox"), "tasks_dir": str(args.tasks_dir),
                    "max_concurrent_episodes": 128, "max_concurrent_creates": 8,
                    "tokenizer_path": str(args.fp8_model_dir),
                    "provider": {"type": "daytona", "auto_stop_interval_min": 30,
                                 "auto_delete_interval_min": 120, "create_timeout_s": 1800.0,
                                 "num_create_retries": 8},
                    "agent": {"max_turns": 30, "max_context_tokens": 65536,
                              "max_new_tokens": 8192, "wall_time_s": 3600.0,
                              "max_command_timeout_s": 900.0, "max_observation_chars": 4000}},
        "rollout": {**service("rollout"),
                    "scheduler": {"max_concurrent_samples": 128, "granularity": "sample",
                                  "n_samples_per_prompt": 8, "num_groups_per_batch": 8,
                                  "max_staleness": 8, "temperature": 0.8,
                                  "max_new_tokens": 8192},
                    "fleet": {"kind": "attach", "attach_urls": urls,
                              "model_path": str(args.fp8_model_dir),
                              "sglang": {**ENGINE_COMMON, **shape["sglang"]}},
                    "weight_update": {"pause_mode": args.pause_mode},
                    "eval": eval_section(args)},
        "trainer": {**service("trainer"), "rollout_batch_size": 8, "max_steps": args.steps,
                    "max_tokens_per_microbatch": 8192,
                    "loss": {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "tis_cap": 2.0,
                             "kl_coef": 0.0},
                    "optimizer": {"lr": 1e-6, "beta1": 0.9, "beta2": 0.98,
                                  "weight_decay": 0.1, "max_grad_norm": 1.0,
                                  "stream_optimizer_state_to_disk": str(args.optimizer_dir),
                                  "bucket_mb": 200e6 * 4 / 2**20,  # 200M fp32 elements
                                  "moments_dtype": "float32"},
                    "model": {"hf_path": str(args.model_dir), "dtype": "bfloat16",
                              "recompute_granularity": "full", "recompute_method": "uniform",
                              "recompute_num_layers": 1},
                    "parallel": {"tensor_parallel": args.tp, "sequence_parallel": args.tp > 1,
                                 "pipeline_parallel": args.pp, "context_parallel": args.cp,
                                 "expert_parallel": args.ep,
                                 "data_parallel": max(1, len(trainer_nodes) * args.gpus_per_node
                                                      // (args.tp * args.pp * args.cp)),
                                 "num_layers_per_stage": [int(x) for x in
                                                          args.pipeline_split.split(",")],
                                 "launcher": "external"},
                    "checkpoint": {"dir": str(_checkpoint_dir(args)), "interval_steps": 4},
                    "weight_sync": {"mode": "rollout", "bucket_mb": 2048.0, "dtype": "bfloat16",
                                    "rollout_address": f"{head}:{ports['rollout']}",
                                    "master_address": head}},
        "slurm": {"head_node": nodes[0], "trainer_nodes": trainer_nodes,
                  "trainer_ranks_per_node": args.gpus_per_node, "engine_program": "sglang",
                  "engine_nodes": engine_nodes, "nodes_per_engine": nodes_per_engine,
                  "engine_port": ports["engine"], "engine_dist_port": ports["engine_dist"],
                  "trainer_master_port": ports["trainer_master"], "bind_host": bind,
                  "redis_dir": str(out / "redis"), "log_dir": str(out / "logs"),
                  "secrets_dir": str(out / "secrets"),
                  "srun_args": list(args.srun_arg),
                  "sandbox_env_files": {"DAYTONA_API_KEY": str(args.daytona_key_file)}},
    }
    if args.smoke:
        _smoke(config, args)
    if args.command == "eval":
        score_deployment(config, args)
    return config


def _smoke(config: dict[str, Any], args: argparse.Namespace) -> None:
    """Shrink the run: a tiny model on the built-in engine, local sandboxes, short episodes."""
    model = str(args.model_dir)
    tasks = str(args.tasks_dir)
    config["sandbox"].update(tasks_dir=tasks, tokenizer_path=model, max_concurrent_episodes=8,
                             provider={"type": "local"},
                             agent={"max_turns": 2, "max_context_tokens": 4096,
                                    "max_new_tokens": 32, "wall_time_s": 120.0,
                                    "default_command_timeout_s": 10.0})
    config["rollout"]["scheduler"].update(max_concurrent_samples=8, n_samples_per_prompt=4,
                                          num_groups_per_batch=2, max_new_tokens=32,
                                          temperature=1.0, max_staleness=4,
                                          # A random tiny model never scores: keep its
                                          # zero-variance groups, or nothing would train.
                                          drop_zero_variance_groups=False)
    config["rollout"]["fleet"].update(model_path=model, sglang={})
    config["engine"] = {"model_path": model}
    trainer = config["trainer"]
    trainer.update(rollout_batch_size=2, max_tokens_per_microbatch=8192)
    trainer["model"] = {"hf_path": model, "dtype": "float32"}
    trainer["optimizer"] = {"lr": 1e-4}
    trainer["parallel"] = {"launcher": "external"}
    trainer["checkpoint"]["interval_steps"] = 1
    trainer["weight_sync"].update(dtype="float32", bucket_mb=16.0)
    config["slurm"].update(engine_program="builtin", trainer_ranks_per_node=1,
                           sandbox_env_files={}, restart_delay_s=1.0, stop_grace_s=20.0)


def smoke_defaults(args: argparse.Namespace) -> None:
    """--smoke's own defaults where the reference ones make no sense."""
    out = args.output_dir.resolve()
    if args.model_dir == Path("/models/glm-5.2"):
        args.model_dir = out / "model"
    args.fp8_model_dir = args.model_dir
    if args.tasks_dir == Path("/data/terminal-bench-2"):
        args.tasks_dir = SMOKE_TASKS
    if args.steps is None:
        args.steps = 3
    args.pipeline_split = "0"
    if args.eval_tasks is None:
        args.eval_tasks = SMOKE_EVAL_TASKS
    if getattr(args, "eval_interval", 0) is None:
        args.eval_interval = SMOKE_EVAL_INTERVAL
    if args.command == "eval" and args.checkpoint is None:
        args.checkpoint = args.model_dir


def model_shape(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The model's config.json keys, and where they came from."""
    config_json = args.model_dir / "config.json"
    if config_json.is_file():
        return json.loads(config_json.read_text()), str(config_json)
    if args.smoke:
        return ({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 264},
                "the tiny model's shape (created at train time)")
    return GLM52, "the reference page's GLM-5.2 shape (no config.json at --model-dir)"


def build(args: argparse.Namespace) -> tuple[Any, dict[str, Any], str]:
    """Validate the flags and return the deployment config, the model shape and its source."""
    if args.smoke:
        smoke_defaults(args)
    elif args.steps is None:
        args.steps = 100
    args.eval_tasks = args.eval_tasks or EVAL_TASKS
    if getattr(args, "eval_interval", 0) is None:
        args.eval_interval = EVAL_INTERVAL
    if args.command == "eval":
        if args.resume:
            raise ConfigError("--resume continues a training run; eval has nothing to resume")
        resolve_checkpoint(args)
    nodes = job_nodes(args)
    hf, source = model_shape(args)
    if args.command == "eval":
        check_engine_shape(args, len(nodes))
    elif not args.smoke:
        check_layout(args, len(nodes), hf)
    token = secrets.token_urlsafe(24)
    return validate_config(deployment(args, nodes, token), "recipe config"), hf, source


def plan_text(config: Any, config_path: Path, hf: dict[str, Any], source: str,
              args: argparse.Namespace) -> str:
    from services.slurm.plan import render_config, render_memory, render_security, render_steps

    nodes = set(config.slurm.trainer_nodes) | set(config.slurm.engine_nodes)
    lines = [f"# Plan: {config.run.name}, {len(nodes | {config.slurm.head_node})} nodes",
             render_steps(config, config_path), "", render_security(config), "",
             render_config(config), "",
             f"model shape: {source}",
             render_memory(config, hf, args.gpu_memory_gb, 1.0 if not args.smoke else 4.0), "",
             *eval_plan(config, args), "",
             "## Riptide lacks (reference setting: what Riptide would need)"]
    lines += [f"  - {row}: {setting}" for row, setting in RIPTIDE_LACKS]
    return "\n".join(lines)


def run_eval(config: Any, hf: dict[str, Any], source: str, args: argparse.Namespace) -> int:
    """eval: check, export a trainer checkpoint if need be, run the score-mode steps, print
    the result."""
    work = eval_dir(args)
    config_path = work / "deploy.toml"
    if args.dry_run:
        print(plan_text(config, config_path, hf, source, args))
        return 0
    if args.smoke and not (args.model_dir / "config.json").exists():
        from services.common.tiny_model import create_tiny_model

        create_tiny_model(args.model_dir)
    check_eval_files(args)
    if args.served_model != args.checkpoint and not (args.served_model / "config.json").exists():
        from services.trainer.weights.export import export_checkpoint

        print(f"[recipe] exporting {args.checkpoint} to {args.served_model}", flush=True)
        export_checkpoint(args.checkpoint, args.model_dir, args.served_model,
                          dtype="float32" if args.smoke else "bfloat16")
    result = Path(config.rollout.eval.result_path)
    result.unlink(missing_ok=True)  # the job is done when this eval's result is there
    code = _launch(config, config_path)
    if code == 0:
        print(result.read_text().rstrip(), flush=True)
    return code


def _launch(config: Any, config_path: Path) -> int:
    """Write the deployment config (private: it holds the tokens) and run its srun steps."""
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(dump_config(config))
    os.chmod(config_path, 0o600)
    print(f"[recipe] config {config_path}", flush=True)
    from services.slurm.supervisor import run

    return int(run(config, config_path))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config, hf, source = build(args)
        config_path = args.output_dir.resolve() / "deploy.toml"
        if args.command == "plan":
            print(plan_text(config, config_path, hf, source, args))
            return 0
        if args.command == "eval":
            return run_eval(config, hf, source, args)
        if args.smoke:
            if not args.dry_run and not (args.model_dir / "config.json").exists():
                from services.common.tiny_model import create_tiny_model

                create_tiny_model(args.model_dir)
            check_task_files(args)
        else:
            check_files(args)
        if args.dry_run:
            print(plan_text(config, config_path, hf, source, args))
            return 0
        return _launch(config, config_path)
    except RiptideError as exc:
        print(f"recipe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
