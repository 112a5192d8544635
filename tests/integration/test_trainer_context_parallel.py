"""Context parallelism on two gloo ranks: log-probs and gradients of a GQA model at CP=2 equal
CP=1 (and Hugging Face) on rows whose length is not a multiple of 2*CP, and the converters
still export the full Hugging Face tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.testing.trainer_ranks import run_ranks


def context_parallel_worker(rank: int, world_size: int, master_port: int) -> dict[str, Any]:
    import torch

    from services.testing.hf_models import random_hf_model, reference_logprobs
    from services.trainer.attention.context_parallel import cp_token_logprobs
    from services.trainer.model.model import ModelShape, build_gpt_model
    from services.trainer.model_config import ParallelConfig
    from services.trainer.objective.logprobs import token_logprobs
    from services.trainer.optim.grad_norm import all_reduce_data_parallel_grads
    from services.trainer.parallel.parallel import init_parallel, teardown_parallel
    from services.trainer.weights import weight_map
    from services.trainer.weights.convert import iter_hf_tensors, load_hf_weights

    hf = random_hf_model("qwen2", num_layers=2, num_heads=4, num_kv_heads=2)
    shape = ModelShape.from_hf(hf.config)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, 19), generator=gen)
    weights = torch.randn(ids.shape, generator=gen)  # a loss that reaches every position
    expected = reference_logprobs(hf, ids)
    results: dict[str, Any] = {}
    runs: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
    for label, cp in (("cp1", 1), ("cp2", 2)):
        init_parallel(ParallelConfig(context_parallel=cp), rank=rank, world_size=world_size,
                      master_port=master_port + cp)  # fmt: skip
        model = build_gpt_model(shape)
        load_hf_weights(model, shape, hf.state_dict())
        logprobs = (cp_token_logprobs if cp > 1 else token_logprobs)(model, ids)
        (logprobs * weights).sum().backward()
        params = list(model.parameters())
        if cp > 1:
            all_reduce_data_parallel_grads(params)  # what the policy's step does
            original = weight_map.checkpoint_state(shape, hf.state_dict())
            back = dict(iter_hf_tensors(model, shape))
            results["round_trip"] = sorted(
                n for n in original if n not in back or not torch.equal(back[n], original[n])
            )
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs[label] = (logprobs.detach(), grads)
        results[f"{label}_hf_diff"] = float((logprobs - expected).abs().max())
        teardown_parallel()
    (lp1, g1), (lp2, g2) = runs["cp1"], runs["cp2"]
    results["logprob_diff"] = float((lp1 - lp2).abs().max())
    assert g1.keys() == g2.keys()
    results["grad_diff"] = max(float((g1[n] - g2[n]).abs().max() / g1[n].abs().max())
                               for n in g1)  # fmt: skip
    results["num_grads"] = len(g1)
    return results


@pytest.mark.slow
def test_cp2_logprobs_and_grads_match_cp1() -> None:
    results = run_ranks(Path(__file__), "context_parallel_worker", 2)
    for rank, r in enumerate(results):
        print(rank, r)
        assert r["cp1_hf_diff"] < 1e-5, rank
        assert r["cp2_hf_diff"] < 1e-5, rank
        assert r["logprob_diff"] < 1e-5, rank
        assert r["num_grads"] > 0
        assert r["grad_diff"] < 1e-5, rank
        assert r["round_trip"] == [], rank
