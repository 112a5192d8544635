"""On two GPUs (NCCL): each two-rank layout the trainer service runs (TP, PP, CP, DP, EP drawn
from DP, TP with sequence parallelism, and MoE under TP + SP with EP across the TP ranks)
trains a tiny model for two steps through the service's own path (`build_policy`, batches
moved to the rank's device, `train_step_for`) and ends with the same Hugging Face tensors,
losses and grad norms as one GPU fed the same batches. The CPU (gloo) versions of these
comparisons run in the other trainer tests; this one checks that the same code holds on CUDA
and NCCL."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from services.testing.trainer_ranks import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

LAYOUTS: dict[str, tuple[str, dict[str, int]]] = {
    "tp2": ("llama", {"tensor_parallel": 2}),
    "pp2": ("llama", {"pipeline_parallel": 2}),
    "cp2": ("qwen2", {"context_parallel": 2}),
    "dp2": ("llama", {"data_parallel": 2}),
    "ep2": ("qwen2_moe", {"expert_parallel": 2, "data_parallel": 2}),
    "sp2": ("qwen3", {"tensor_parallel": 2, "sequence_parallel": 1}),
    "sp2_ep2": ("qwen2_moe", {"tensor_parallel": 2, "sequence_parallel": 1, "expert_parallel": 2}),
}


def _batches(vocab: int) -> list[Any]:
    from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Group, Trajectory
    from services.trainer.data.batch import pack_groups

    gen = torch.Generator().manual_seed(11)
    batches = []
    for step in range(2):
        entries = []
        for g in range(2):
            samples = []
            for i in range(3):
                response = torch.randint(1, vocab, (5 + 2 * i + g,), generator=gen).tolist()
                samples.append(Trajectory(
                    prompt_ids=torch.randint(1, vocab, (3,), generator=gen).tolist(),
                    response_ids=response, loss_mask=[1] * len(response),
                    rollout_logprobs=[-4.0] * len(response), reward=float((i + step) % 2),
                    status=VERDICT_STATUS_SCORED,
                ))  # fmt: skip
            entries.append((f"{step}-{g}", Group(group_id=f"g{step}-{g}", samples=samples)))
        batches.append(pack_groups(entries, normalize_std=True, max_tokens_per_microbatch=24))
    return batches


def _train(model_dir: str, parallel: dict[str, int], rank: int, world: int, port: int) -> Any:
    from services.trainer.config import TrainerConfig
    from services.trainer.megatron_policy import RankAddress, build_policy
    from services.trainer.parallel.parallel import teardown_parallel
    from services.trainer.pipeline_step import train_step_for
    from services.trainer.weights.convert import iter_hf_tensors

    config = TrainerConfig.model_validate({
        "rollout_batch_size": 2, "num_minibatches": 2,
        "model": {"hf_path": model_dir, "dtype": "float32"},
        "optimizer": {"lr": 1e-4, "eps": 1e-6, "max_grad_norm": 0.5},
        "parallel": parallel,
    })  # fmt: skip
    built = build_policy(config, RankAddress(rank, world, "127.0.0.1", port))
    assert built.device.type == "cuda" and built.backend == "nccl"
    step = train_step_for(config.parallel)
    metrics = [
        step(built.policy, batch.on_device(built.device), config.loss.settings(), 2,
             built.reference, built.shard)
        for batch in _batches(built.shape.vocab_size)
    ]  # fmt: skip
    hf = {k: v.float().cpu() for k, v in iter_hf_tensors(built.model, built.shape)}
    teardown_parallel()
    return metrics, hf


def layout_worker(
    rank: int, world_size: int, master_port: int, model_dir: str, parallel: dict[str, int],
    out: str,
) -> list[dict[str, float]]:
    metrics, hf = _train(model_dir, parallel, rank, world_size, master_port)
    if rank == 0:
        torch.save(hf, out)
    return metrics  # type: ignore[no-any-return]


def test_two_gpu_layouts_train_like_one_gpu() -> None:
    from services.testing.hf_models import random_hf_model

    work = Path(tempfile.mkdtemp(prefix="riptide-gpu-layouts-"))
    try:
        archs = sorted({arch for arch, _ in LAYOUTS.values()})
        for arch in archs:
            random_hf_model(arch, num_layers=2).save_pretrained(work / arch)
        results: dict[str, list[Any]] = {}
        runs = {f"one-{arch}": (arch, {}) for arch in archs} | LAYOUTS
        for key, (arch, parallel) in runs.items():
            results[key] = run_ranks(Path(__file__), "layout_worker", 1 if parallel == {} else 2, {
                "model_dir": str(work / arch), "parallel": parallel, "out": str(work / key),
            })  # fmt: skip
        for name, (arch, _) in LAYOUTS.items():
            one = torch.load(work / f"one-{arch}", weights_only=False)
            ours = torch.load(work / name, weights_only=False)
            assert set(ours) == set(one)
            diff = max(float((ours[k] - one[k]).abs().max()) for k in ours)
            print(f"{name}: max |two GPUs - one GPU| = {diff:.2e}")
            assert diff < 1e-4, name
            [ref_metrics] = results[f"one-{arch}"]
            for mine, ref in zip(results[name][0], ref_metrics, strict=True):
                assert abs(mine["loss"] - ref["loss"]) < 1e-4, (name, mine, ref)
                assert abs(mine["grad_norm"] - ref["grad_norm"]) < 1e-3 * ref["grad_norm"], name
            assert results[name][1] == results[name][0], name
    finally:
        shutil.rmtree(work, ignore_errors=True)
