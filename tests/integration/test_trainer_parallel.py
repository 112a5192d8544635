"""The converters and log-probs across two gloo ranks: parity with Hugging Face and round
trips at TP=2, PP=2 (through megatron's pipeline schedule) and EP=2 (Qwen3-MoE)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.testing.trainer_ranks import run_ranks


def parallel_worker(rank: int, world_size: int, master_port: int) -> dict[str, Any]:
    import torch

    from services.testing.hf_models import random_hf_model, reference_logprobs
    from services.trainer.model.model import ModelShape, build_gpt_model
    from services.trainer.model_config import ParallelConfig
    from services.trainer.objective.logprobs import pipelined_token_logprobs, token_logprobs
    from services.trainer.parallel.parallel import init_parallel, teardown_parallel
    from services.trainer.weights import weight_map
    from services.trainer.weights.convert import iter_hf_tensors, load_hf_weights

    results: dict[str, Any] = {}
    layouts = {
        "tp2": ("qwen2", ParallelConfig(tensor_parallel=2)),
        "pp2": ("llama", ParallelConfig(pipeline_parallel=2)),
        "ep2": ("qwen3_moe", ParallelConfig(expert_parallel=2)),
    }
    for label, (arch, parallel) in layouts.items():
        layout = init_parallel(parallel, rank=rank, world_size=world_size,
                               master_port=master_port)
        hf = random_hf_model(arch, num_layers=2)
        shape = ModelShape.from_hf(hf.config)
        model = build_gpt_model(shape)
        load_hf_weights(model, shape, hf.state_dict())
        original = weight_map.checkpoint_state(shape, hf.state_dict())
        back = dict(iter_hf_tensors(model, shape))
        results[f"{label}_round_trip"] = sorted(n for n, t in back.items()
                                                if not torch.equal(t, original[n]))
        results[f"{label}_num_tensors"] = [len(back), len(original)]
        ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(5))
        ours: torch.Tensor | None
        if layout.pp_size == 1:
            with torch.no_grad():
                ours = token_logprobs(model, ids)
        else:
            ours = pipelined_token_logprobs(model, ids, micro_batch_size=1)
        if ours is not None:  # None on pipeline stages before the last
            diff = (ours - reference_logprobs(hf, ids)).abs().max()
            results[f"{label}_logprob_diff"] = float(diff)
        teardown_parallel()
        master_port += 1
    return results


@pytest.mark.slow
def test_two_ranks_match_hf_and_round_trip() -> None:
    results = run_ranks(Path(__file__), "parallel_worker", 2)
    for rank, result in enumerate(results):
        for label in ("tp2", "pp2", "ep2"):
            assert result[f"{label}_round_trip"] == [], (rank, label)
            assert result[f"{label}_num_tensors"][0] == result[f"{label}_num_tensors"][1]
        assert result["tp2_logprob_diff"] < 1e-4, rank
        assert result["ep2_logprob_diff"] < 1e-4, rank
    assert "pp2_logprob_diff" not in results[0]
    assert results[1]["pp2_logprob_diff"] < 1e-4
