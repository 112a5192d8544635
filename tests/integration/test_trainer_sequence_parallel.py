"""Sequence parallelism: two gloo ranks with TP=2 and sequence_parallel train (1) a dense
Qwen3 (per-head q/k norms), (2) a Qwen2-MoE with EP=2 drawn from the two TP ranks (DP=1;
shared-expert gate and router on the split sequence) and (3) GLM-5 (MLA's latent norms and
KV projection, sigmoid router, EP=2), and end with the parameters, grad norms and losses of
one rank fed the same batches. Every row has an odd length, so the forward pads it to a
multiple of TP; the loss tokens' log-probs equal Hugging Face's."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from services.testing.trainer_ranks import run_ranks

NUM_STEPS = 2
SP_EP2 = {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2}
LAYOUTS = {  # name: (architecture, its overrides, parallel section)
    "dense": ("qwen3", {}, {"tensor_parallel": 2, "sequence_parallel": True}),
    "moe": ("qwen2_moe", {}, SP_EP2),
    "mla": ("glm_moe_dsa", {"num_kv_heads": 4}, SP_EP2),
}


def _batches(vocab: int) -> list[Any]:
    from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Group, Trajectory
    from services.trainer.data.batch import pack_groups

    gen = torch.Generator().manual_seed(11)
    batches = []
    for step in range(NUM_STEPS):
        samples = []
        for i in range(3):  # rows of 3 + 4 + 2i tokens: 7, 9, 11
            prompt = torch.randint(1, vocab, (3,), generator=gen).tolist()
            response = torch.randint(1, vocab, (4 + 2 * i,), generator=gen).tolist()
            samples.append(Trajectory(
                prompt_ids=prompt, response_ids=response, loss_mask=[1] * len(response),
                rollout_logprobs=[-4.0] * len(response), reward=float((i + step) % 2),
                status=VERDICT_STATUS_SCORED,
            ))  # fmt: skip
        group = Group(group_id=f"g{step}", samples=samples)
        batches.append(pack_groups([(str(step), group)], normalize_std=True,
                                   max_tokens_per_microbatch=20))  # fmt: skip
    return batches


def _config(model_dir: str, parallel: dict[str, Any]) -> Any:
    from services.trainer.config import TrainerConfig

    return TrainerConfig.model_validate({
        "rollout_batch_size": 1,
        "model": {"hf_path": model_dir, "dtype": "float32"},
        # eps 1e-6: Adam must not turn near-zero gradients' rounding noise into full steps.
        "optimizer": {"lr": 1e-4, "eps": 1e-6, "max_grad_norm": 0.5},
        "parallel": parallel,
    })  # fmt: skip


def _train(config: Any, rank: int, world_size: int, master_port: int) -> dict[str, Any]:
    """Log-probs of the first batch, then NUM_STEPS steps: the metrics and the exported
    (TP- and EP-gathered) Hugging Face tensors."""
    from services.trainer.megatron_policy import RankAddress, build_policy
    from services.trainer.parallel.parallel import teardown_parallel
    from services.trainer.step import train_step
    from services.trainer.weights.convert import iter_hf_tensors

    built = build_policy(config, RankAddress(rank, world_size, "127.0.0.1", master_port))
    batches = _batches(built.shape.vocab_size)
    with torch.no_grad():
        logprobs = [built.policy.logprobs(mb) for mb in batches[0].micro_batches]
    initial = {k: v.clone() for k, v in iter_hf_tensors(built.model, built.shape)}
    metrics = [train_step(built.policy, batch, config.loss.settings(), 1, None, built.shard)
               for batch in batches]  # fmt: skip
    trained = {k: v.clone() for k, v in iter_hf_tensors(built.model, built.shape)}
    teardown_parallel()
    return {"logprobs": logprobs, "initial": initial, "trained": trained, "metrics": metrics}


def sp_worker(rank: int, world_size: int, master_port: int, work: str) -> None:
    from services.common.ports import free_port

    for index, (name, (_, _, parallel)) in enumerate(LAYOUTS.items()):
        config = _config(f"{work}/{name}-model", parallel)
        sp = _train(config, rank, world_size, master_port + index)
        torch.save(sp, f"{work}/{name}-rank{rank}.pt")
        if rank == index % world_size:  # the reference: one rank, the same batches
            one = _train(_config(f"{work}/{name}-model", {}), 0, 1, free_port())
            torch.save(one, f"{work}/{name}-one.pt")


def _max_diff(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert set(ours) == set(ref)
    diffs = {k: float((ours[k] - ref[k]).abs().max()) for k in ref}
    worst = max(diffs, key=diffs.__getitem__)
    return diffs[worst], worst


@pytest.fixture(scope="module")
def work() -> Any:
    from services.testing.hf_models import random_hf_model

    # Odd widths in both steps: micro-batches [1x11, 2x9] (at most 20 padded tokens).
    shapes = [tuple(mb.input_ids.shape) for b in _batches(96) for mb in b.micro_batches]
    assert all(width % 2 for _, width in shapes), shapes
    path = Path(tempfile.mkdtemp(prefix="riptide-trainer-sp-"))
    try:
        for name, (arch, overrides, _) in LAYOUTS.items():
            model = random_hf_model(arch, num_layers=2, **overrides)
            model.save_pretrained(path / f"{name}-model")
        run_ranks(Path(__file__), "sp_worker", 2, {"work": str(path)})
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _check(work: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM

    from services.testing.hf_models import reference_logprobs

    ranks = [torch.load(work / f"{name}-rank{r}.pt", weights_only=False) for r in range(2)]
    one = torch.load(work / f"{name}-one.pt", weights_only=False)
    hf = AutoModelForCausalLM.from_pretrained(work / f"{name}-model", attn_implementation="eager")
    for ours, mb in zip(ranks[0]["logprobs"], _batches(96)[0].micro_batches, strict=True):
        assert ours.shape == mb.input_ids.shape  # the TP padding is cut off again
        scored = mb.loss_mask > 0  # the trainer scores the loss tokens only
        assert int(scored.sum()) > 0 and bool((ours[~scored] == 0).all())
        diff = (ours - reference_logprobs(hf, mb.input_ids))[scored]
        assert float(diff.abs().max()) < 1e-4
    for r in range(2):  # every rank exports the same, fully trained weights
        diff, worst = _max_diff(ranks[r]["trained"], one["trained"])
        print(f"{name}: max |TP=2 SP rank {r} - one rank| = {diff:.2e} at {worst}")
        assert diff < 1e-5, worst
    assert _max_diff(one["trained"], one["initial"])[0] > 1e-4  # training moved the weights
    for ours, ref in zip(ranks[0]["metrics"], one["metrics"], strict=True):
        assert ours["grad_norm"] > 0.5  # clipping is active, so the norm must be global
        assert abs(ours["grad_norm"] - ref["grad_norm"]) < 1e-4 * ref["grad_norm"]
        assert abs(ours["loss"] - ref["loss"]) < 1e-5
    assert ranks[1]["metrics"] == ranks[0]["metrics"]


@pytest.mark.slow
def test_dense_tp2_sequence_parallel_matches_one_rank(work: Path) -> None:
    _check(work, "dense")


@pytest.mark.slow
def test_moe_tp2_sequence_parallel_ep2_matches_one_rank(work: Path) -> None:
    _check(work, "moe")


@pytest.mark.slow
def test_mla_tp2_sequence_parallel_ep2_matches_one_rank(work: Path) -> None:
    _check(work, "mla")
