"""Trainer steps on the real megatron model (one gloo rank, CPU, bf16 params).

A few steps on a fixed batch reduce the loss; the disk-streamed optimizer state gives the
same parameters as the in-memory one, and as megatron-core's own DistributedOptimizer (run
on the CPU through the shim), bit for bit over several steps.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from services.testing.trainer_ranks import run_ranks


def _fixed_batch(vocab: int) -> Any:
    import torch

    from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Group, Trajectory
    from services.trainer.data.batch import pack_groups

    gen = torch.Generator().manual_seed(3)
    entries = []
    for g in range(2):
        samples = []
        for i in range(4):
            prompt = torch.randint(0, vocab, (5 + g,), generator=gen).tolist()
            response = torch.randint(0, vocab, (6 + i,), generator=gen).tolist()
            samples.append(Trajectory(
                prompt_ids=prompt, response_ids=response, loss_mask=[1] * len(response),
                rollout_logprobs=[0.0] * len(response), reward=float(i % 2),
                status=VERDICT_STATUS_SCORED,
            ))  # fmt: skip
        entries.append((f"{g}-0", Group(group_id=f"g{g}", samples=samples)))
    return pack_groups(entries, normalize_std=True, max_tokens_per_microbatch=40)


def _against_megatron_optimizer(shape: Any, hf: Any) -> list[float]:
    """Max |param difference| per step: MasterAdam (disk) vs megatron DDP + DistributedOptimizer."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from services.trainer.model.model import build_gpt_model
    from services.trainer.objective.logprobs import token_logprobs
    from services.trainer.optim.optimizer_stream import MasterAdam
    from services.trainer.weights.convert import load_hf_weights

    models = []
    for _ in range(2):
        model = build_gpt_model(shape, dtype="bfloat16")
        load_hf_weights(model, shape, hf.state_dict())
        models.append(model)
    ref, mine = models
    ddp = DistributedDataParallel(ref.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), ref)  # fmt: skip
    # Without megatron's LR scheduler its wd_mult overrides are not applied: decay on all.
    config = OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, use_distributed_optimizer=True, clip_grad=0.0, bf16=True,
        params_dtype=torch.bfloat16,
    )  # fmt: skip
    reference = get_megatron_optimizer(config, [ddp])
    state_dir = tempfile.mkdtemp(prefix="optstate-")
    opt = MasterAdam(list(mine.parameters()), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                     weight_decay=0.1, state_dir=state_dir, bucket_mb=0.05)
    ids = torch.randint(0, shape.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    diffs = []
    for _ in range(4):
        ddp.zero_grad_buffer()
        reference.zero_grad()
        (-token_logprobs(ddp, ids).mean()).backward()
        ddp.finish_grad_sync()
        assert reference.step()[0]
        (-token_logprobs(mine, ids).mean()).backward()
        opt.step()
        opt.zero_grad()
        diffs.append(max((a.float() - b.float()).abs().max().item()
                         for a, b in zip(ref.parameters(), mine.parameters(), strict=True)))
    shutil.rmtree(state_dir, ignore_errors=True)
    return diffs


def step_worker(rank: int, world_size: int, master_port: int) -> dict[str, Any]:
    import torch

    from services.testing.hf_models import random_hf_model
    from services.trainer.model.model import ModelShape, build_gpt_model
    from services.trainer.model.policy import ModelPolicy
    from services.trainer.model_config import ParallelConfig
    from services.trainer.objective.logprobs import token_logprobs
    from services.trainer.objective.loss import LossSettings, policy_loss
    from services.trainer.optim.optimizer_stream import MasterAdam
    from services.trainer.parallel.parallel import init_parallel
    from services.trainer.step import train_step
    from services.trainer.weights.convert import load_hf_weights

    init_parallel(ParallelConfig(), rank=rank, world_size=world_size, master_port=master_port)
    hf = random_hf_model("llama")
    shape = ModelShape.from_hf(hf.config)
    batch = _fixed_batch(shape.vocab_size)
    policies = []
    for state_dir in (None, tempfile.mkdtemp(prefix="optstate-")):
        model = build_gpt_model(shape, dtype="bfloat16")
        load_hf_weights(model, shape, hf.state_dict())
        opt = MasterAdam(list(model.parameters()), lr=3e-3, state_dir=state_dir, bucket_mb=0.05)
        policies.append(ModelPolicy(model, opt, token_logprobs, max_grad_norm=1.0))
    memory, disk = policies
    with torch.no_grad():  # on-policy rollout log-probs, slightly perturbed to exercise TIS
        gen = torch.Generator().manual_seed(1)
        for mb in batch.micro_batches:
            noise = 0.05 * torch.randn(mb.input_ids.shape, generator=gen)
            mb.rollout_logprobs = (memory.logprobs(mb) + noise) * mb.loss_mask
        anchors = [memory.logprobs(mb) for mb in batch.micro_batches]
    wide = LossSettings(clip_eps_low=0.99, clip_eps_high=100.0, tis_cap=None)

    def surrogate() -> float:  # the PPO objective against the fixed initial policy
        total, tokens = 0.0, 0
        with torch.no_grad():
            for mb, anchor in zip(batch.micro_batches, anchors, strict=True):
                loss, _ = policy_loss(memory.logprobs(mb), anchor, anchor, mb.advantages,
                                      mb.loss_mask, wide)
                total += loss.item() * mb.num_loss_tokens
                tokens += mb.num_loss_tokens
        return total / tokens

    losses, metrics = [surrogate()], []
    for _ in range(4):
        for policy in (memory, disk):
            m = train_step(policy, batch, LossSettings(), num_minibatches=2)
        metrics.append(m)
        losses.append(surrogate())
    shutil.rmtree(state_dir, ignore_errors=True)
    same = all(torch.equal(a, b) for a, b in zip(memory.model.parameters(),
                                                  disk.model.parameters(), strict=True))
    return {"losses": losses, "same_params": same, "metrics": metrics,
            "megatron_diffs": _against_megatron_optimizer(shape, hf),
            "dtype": str(next(memory.model.parameters()).dtype),
            "num_buckets": len(disk.optimizer.buckets)}


@pytest.mark.slow
def test_steps_reduce_loss_and_disk_optimizer_matches_memory() -> None:
    (result,) = run_ranks(Path(__file__), "step_worker", 1, timeout_s=240)
    losses = result["losses"]
    assert result["dtype"] == "torch.bfloat16" and result["num_buckets"] > 3
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < losses[0] - 0.1, losses
    assert result["same_params"]
    assert result["megatron_diffs"] == [0.0] * 4
    last = result["metrics"][-1]
    assert last["num_loss_tokens"] > 0 and last["mismatch_kl"] > 0
    assert 0 <= last["clip_frac"] <= 1 and last["grad_norm"] > 0
