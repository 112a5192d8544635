"""Rollout Routing Replay measured end to end on CPU, for its test and its bench.

A tiny Qwen2-MoE model (bfloat16-representable weights) is served by the built-in engine in
bfloat16, as engines run, and scored by the megatron trainer in float32 at the same weights:
the engine samples completions and returns their log-probs and routed experts; the trainer
scores them routing by itself and replaying the engine's routes, and trains one step on
samples with routes and one where a sample has none. `measure_replay` returns the mismatch KL
both ways, how often the two routings differ, whether the replayed routes are the engine's,
and the steps' replay counts. Used by tests/integration/test_routing_replay.py and
bench/routing_replay.py.
"""

from __future__ import annotations

import base64
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

NUM_LAYERS, NUM_EXPERTS, TOP_K = 4, 8, 2


def _bf16_moe_model(folder: Path) -> Path:
    """The tiny MoE model with weights rounded to bfloat16, so both sides hold the same."""
    from transformers import AutoModelForCausalLM

    from services.common.tiny_model import create_tiny_model

    create_tiny_model(folder, num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS, seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    model.save_pretrained(folder)
    return folder


def _rollouts(model_dir: Path, num_prompts: int, max_new_tokens: int) -> list[dict[str, Any]]:
    """Sampled completions of random prompts with the engine's log-probs and routes."""
    from services.testing.engine_process import EngineProcess

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (12 + 3 * i,), generator=gen).tolist()
               for i in range(num_prompts)]
    args = ["--enable-return-routed-experts", "--dtype", "bfloat16"]
    with EngineProcess(model_dir, extra_args=args) as engine:
        body = {"input_ids": prompts, "return_logprob": True, "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0,
                                    "ignore_eos": True,
                                    "sampling_seed": 5}}
        responses = engine.client.post("/generate", json=body, timeout=120).json()
    out = []
    for prompt, response in zip(prompts, responses, strict=True):
        raw = base64.b64decode(response["meta_info"]["routed_experts"])
        routes = np.frombuffer(raw, dtype="<i4").reshape(-1, NUM_LAYERS, TOP_K)
        output = response["output_ids"]
        assert routes.shape[0] == len(prompt) + len(output) - 1  # every forwarded position
        logprobs = [lp for lp, _, _ in response["meta_info"]["output_token_logprobs"]]
        out.append({"prompt": prompt, "output": output, "routes": routes.tolist(),
                    "logprobs": logprobs})
    return out


def _trajectory(rollout: dict[str, Any], with_routes: bool, index: int) -> Any:
    from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Trajectory
    from services.common.routed_experts import pack_routes

    n = len(rollout["prompt"]) + len(rollout["output"])
    packed, present = pack_routes(n, [(0, np.array(rollout["routes"]))] if with_routes else [])
    return Trajectory(
        sample_id=f"s{index}", prompt_ids=rollout["prompt"], response_ids=rollout["output"],
        loss_mask=[1] * len(rollout["output"]), rollout_logprobs=rollout["logprobs"],
        reward=float(index % 2), status=VERDICT_STATUS_SCORED, routed_experts=packed,
        routed_experts_present=present, routed_experts_num_layers=NUM_LAYERS,
        routed_experts_top_k=TOP_K)


def replay_worker(rank: int, world_size: int, master_port: int, model_dir: str,
                  rollouts: list[dict[str, Any]]) -> dict[str, Any]:
    from services._proto.riptide.v1.common_pb2 import Group
    from services.trainer.config import TrainerConfig
    from services.trainer.data.batch import pack_groups
    from services.trainer.megatron_policy import RankAddress, build_policy
    from services.trainer.model.policy import logprob_keywords
    from services.trainer.objective.loss import LossSettings, mismatch_kl
    from services.trainer.step import train_step

    config = TrainerConfig.model_validate({
        "rollout_batch_size": 1, "model": {"hf_path": model_dir, "dtype": "float32"},
        "optimizer": {"lr": 1e-5}, "loss": {"routing_replay": True}})
    built = build_policy(config, RankAddress(rank, world_size, "127.0.0.1", master_port))
    policy, replay = built.policy, built.policy.routing_replay
    assert replay is not None and len(replay.hooks) == NUM_LAYERS
    group = Group(group_id="g", samples=[_trajectory(r, True, i) for i, r in enumerate(rollouts)])
    batch = pack_groups([("e", group)], normalize_std=False, max_tokens_per_microbatch=4096)
    (mb,) = batch.micro_batches
    kls, flips, mismatched = {}, 0, 0
    with torch.no_grad():
        replay.set_routes(None, mb.lengths, mb.cu_seqlens)  # the trainer's own routing
        free = policy.logprob_fn(policy.model, mb.input_ids, **logprob_keywords(mb, 1.0))
        own = [_last_ids(h) for h in replay.hooks]
        replayed = policy.logprobs(mb)
        kls["free"] = float(mismatch_kl(free, mb.rollout_logprobs, mb.loss_mask)["mismatch_kl"])
        kls["replay"] = float(mismatch_kl(replayed, mb.rollout_logprobs,
                                          mb.loss_mask)["mismatch_kl"])
    # The engine's routes of every forwarded token, in megatron's [S, B] token order.
    routes = mb.routed_experts
    assert routes is not None
    needed = (routes >= 0).all(-1).all(-1).transpose(0, 1).reshape(-1)
    for hook, mine in zip(replay.hooks, own, strict=True):
        engine = routes[:, :, hook.moe_index].transpose(0, 1).reshape(-1, TOP_K)[needed]
        used = _last_ids(hook)[needed]
        mismatched += int((used != engine).any(-1).sum())
        flips += int((mine[needed].sort(-1).values != engine.sort(-1).values).any(-1).sum())
    num_routed = int(needed.sum())
    # One step on routed samples, then one where a sample carries no routes.
    replay.take_counts()
    routed_step = train_step(policy, batch, LossSettings())
    bare = Group(group_id="h", samples=[_trajectory(rollouts[0], False, 0),
                                        _trajectory(rollouts[1], True, 1)])
    bare_batch = pack_groups([("f", bare)], normalize_std=False, max_tokens_per_microbatch=4096)
    bare_step = train_step(policy, bare_batch, LossSettings())
    return {"kl": kls, "mismatched": mismatched, "flips": flips, "num_routed": num_routed,
            "routed_step": routed_step, "bare_step": bare_step}


def _last_ids(hook: Any) -> torch.Tensor:
    assert hook.last_ids is not None, "the router hook ran no forward"
    return hook.last_ids.clone()


def measure_replay(num_prompts: int = 6, max_new_tokens: int = 40) -> dict[str, Any]:
    """Sample with the engine, then score and train with the trainer (one rank, its own
    process); returns replay_worker's figures plus the rollouts' token counts."""
    from services.testing.trainer_ranks import run_ranks

    work = Path(tempfile.mkdtemp(prefix="riptide-r3-"))
    try:
        model_dir = _bf16_moe_model(work / "model")
        rollouts = _rollouts(model_dir, num_prompts, max_new_tokens)
        (result,) = run_ranks(Path(__file__), "replay_worker", 1,
                              {"model_dir": str(model_dir), "rollouts": rollouts},
                              timeout_s=300)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["num_tokens"] = [len(r["prompt"]) + len(r["output"]) for r in rollouts]
    return dict(result)
