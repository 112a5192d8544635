"""Pipeline-parallel training (pipeline_step.py) on four gloo ranks against one rank.

A tiny Llama with tied embeddings trains a few steps at PP=2 x DP=2 (the last stage holds the
tied copy of the word embeddings), with micro-batches of different shapes, two minibatches
per step and a KL term to a pipelined reference model; it must end with the Hugging Face
tensors (what a weight sync sends) and the metrics of a one-rank trainer fed the same
batches. The service-level PP=2 run is in test_trainer_tp.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.testing.trainer_ranks import run_ranks

NUM_STEPS = 2


def _batches(max_tokens: int) -> list[Any]:
    import torch

    from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Group, Trajectory
    from services.trainer.data.batch import pack_groups

    batches = []
    for step in range(NUM_STEPS):
        entries = []
        for g in range(2):
            gen = torch.Generator().manual_seed(10 * step + g)
            samples = []
            for i in range(3):
                n = 4 + 2 * i + g
                samples.append(Trajectory(
                    sample_id=f"s{step}-{g}-{i}", prompt_ids=[1, 2, 3 + g],
                    response_ids=torch.randint(3, 250, (n,), generator=gen).tolist(),
                    loss_mask=[1] * (n - 1) + [0], rollout_logprobs=[-3.0 - 0.1 * i] * n,
                    reward=float(i == (step + g) % 3), status=VERDICT_STATUS_SCORED,
                ))  # fmt: skip
            entries.append((f"e{step}-{g}", Group(group_id=f"g{step}-{g}", samples=samples)))
        batches.append(pack_groups(entries, True, max_tokens))
    return batches


def _config(model_path: str, pp: int) -> Any:
    from services.trainer.config import TrainerConfig

    return TrainerConfig.model_validate({
        "num_minibatches": 2,
        "max_tokens_per_microbatch": 24,
        "loss": {"kl_coef": 0.1},
        "model": {"hf_path": model_path, "dtype": "float32"},
        "optimizer": {"lr": 1e-3, "eps": 1e-6, "max_grad_norm": 0.5},
        "parallel": {"pipeline_parallel": pp},
        "weight_sync": {"mode": "off"},
    })  # fmt: skip


def _train(rank: int, world_size: int, master_port: int, model_path: str, pp: int) -> Any:
    """Build the policy on this rank, train NUM_STEPS batches; returns (built, metrics)."""
    from services.trainer import pipeline_step, step
    from services.trainer.megatron_policy import RankAddress, build_policy

    config = _config(model_path, pp)
    built = build_policy(config, RankAddress(rank, world_size, "127.0.0.1", master_port))
    train = pipeline_step.train_step if pp > 1 else step.train_step
    metrics = [
        train(built.policy, batch, config.loss.settings(), config.num_minibatches,
              built.reference, built.shard)
        for batch in _batches(config.max_tokens_per_microbatch)
    ]  # fmt: skip
    return built, metrics


def pipeline_worker(rank: int, world_size: int, master_port: int, model_path: str) -> Any:
    """PP=2 x DP=2 over all ranks, then (rank 0) one rank; rank 0 returns both results."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from services.common.ports import free_port
    from services.trainer.parallel.parallel import teardown_parallel
    from services.trainer.weights.convert import iter_hf_tensors

    built, pp_metrics = _train(rank, world_size, master_port, model_path, pp=2)
    assert built.shard is not None and built.shard.size == 2
    pp_tensors = dict(iter_hf_tensors(built.model, built.shape))
    # The last stage's copy of the tied embeddings must have taken the same steps.
    embedding = (built.model.embedding.word_embeddings.weight.detach().clone()
                 if built.layout.is_first_stage
                 else built.model.output_layer.weight.detach().clone())  # fmt: skip
    copies = [torch.empty_like(embedding) for _ in range(2)]
    dist.all_gather(copies, embedding, group=ps.get_pipeline_model_parallel_group())
    copy_diff = float((copies[0] - copies[1]).abs().max())
    teardown_parallel()
    if rank != 0:
        return None
    one, one_metrics = _train(0, 1, free_port(), model_path, pp=1)
    one_tensors = dict(iter_hf_tensors(one.model, one.shape))
    teardown_parallel()
    assert pp_tensors.keys() == one_tensors.keys()
    diffs = {k: float((pp_tensors[k] - one_tensors[k]).abs().max()) for k in one_tensors}
    initial = _initial(model_path)
    moved = max(float((one_tensors[k] - initial[k]).abs().max()) for k in one_tensors)
    return {"diffs": diffs, "copy_diff": copy_diff, "moved": moved, "pp": pp_metrics,
            "one": one_metrics}


def _initial(model_path: str) -> dict[str, Any]:
    from services.trainer.weights.convert import SafetensorsFolder

    return dict(SafetensorsFolder(model_path))


def _tied_tiny_model(path: Path) -> Path:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from services.common.tiny_model import create_tiny_model

    config = AutoConfig.from_pretrained(create_tiny_model(path / "untied", hidden_size=32))
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path / "tied")
    return path / "tied"


@pytest.mark.slow
def test_pp2_dp2_with_tied_embeddings_trains_like_one_rank(tmp_path: Path) -> None:
    model = _tied_tiny_model(tmp_path)
    result, *_ = run_ranks(Path(__file__), "pipeline_worker", 4, {"model_path": str(model)})
    worst = max(result["diffs"], key=result["diffs"].__getitem__)
    print("max |pp2 - one rank| =", result["diffs"][worst], "at", worst,
          "; moved from initial", result["moved"], "; tied copy diff", result["copy_diff"])
    assert "lm_head.weight" not in result["diffs"]  # tied: the engines get the embedding only
    assert result["moved"] > 1e-3
    assert result["diffs"][worst] < 1e-5, result["diffs"]
    assert result["copy_diff"] == 0.0
    for pp, one in zip(result["pp"], result["one"], strict=True):
        assert pp.keys() == one.keys()
        for key, value in one.items():
            assert abs(pp[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, pp, one)
