"""GLM-5 (MLA, sigmoid router, DSA indexers and an MTP layer) across two gloo ranks: parity
with Hugging Face and round trips at TP=2 (also with sequence parallelism), EP=2, PP=2 and
CP=2, on rows longer than the DSA indexer's top-k (so sparse attention and layers sharing the
top-k run); under CP the attention gradients, summed over the ranks, equal Hugging Face's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.testing.trainer_ranks import run_ranks


def mla_worker(rank: int, world_size: int, master_port: int) -> dict[str, Any]:
    import torch

    from services.testing.hf_models import random_hf_model, reference_logprobs
    from services.trainer.attention.context_parallel import cp_token_logprobs
    from services.trainer.model.model import ModelShape, build_gpt_model
    from services.trainer.model_config import ParallelConfig
    from services.trainer.objective.logprobs import pipelined_token_logprobs, token_logprobs
    from services.trainer.parallel.parallel import init_parallel, teardown_parallel
    from services.trainer.weights import weight_map
    from services.trainer.weights.convert import iter_hf_tensors, load_hf_weights
    from services.trainer.weights.weight_map_mla import MTP_PREFIX, carried_rules

    results: dict[str, Any] = {}
    # Plain TP=2 with dense layers only (megatron runs MoE layers under TP only with sequence
    # parallelism); TP=2 with SP includes an MoE layer.
    layouts = {
        "tp2": (ParallelConfig(tensor_parallel=2), 4),
        "sp2": (ParallelConfig(tensor_parallel=2, sequence_parallel=True), 3),
        "ep2": (ParallelConfig(expert_parallel=2), 1),
        "pp2": (ParallelConfig(pipeline_parallel=2), 1),
        "cp2": (ParallelConfig(context_parallel=2), 1),
    }
    for label, (parallel, num_dense) in layouts.items():
        layout = init_parallel(parallel, rank=rank, world_size=world_size,
                               master_port=master_port)
        hf = random_hf_model("glm_moe_dsa", num_layers=4, num_kv_heads=4,
                             num_nextn_predict_layers=1, first_k_dense_replace=num_dense,
                             index_topk=6, index_n_heads=8)
        shape = ModelShape.from_hf(hf.config)
        original = weight_map.checkpoint_state(shape, hf.state_dict())
        gen = torch.Generator().manual_seed(7)
        for rule in carried_rules(shape):  # type: ignore[arg-type]
            if rule.mcore.startswith(MTP_PREFIX):  # transformers does not build the MTP layer
                full = torch.randn(rule.full_shape, generator=gen)
                original.update(zip(rule.hf, weight_map.unfuse(rule, shape, full), strict=True))
        model = build_gpt_model(shape, sequence_parallel=parallel.sequence_parallel)
        load_hf_weights(model, shape, original)
        back = dict(iter_hf_tensors(model, shape))
        results[f"{label}_round_trip"] = sorted(n for n, t in back.items()
                                                if not torch.equal(t, original[n]))
        results[f"{label}_num_tensors"] = [len(back), len(original)]
        ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(5))
        ours: torch.Tensor | None
        if layout.cp_size > 1:
            ours = cp_token_logprobs(model, ids)
            results[f"{label}_grad_diff"] = _cp_grad_diff(model, hf, ids, ours)
            ours = ours.detach()
        elif layout.pp_size == 1:
            with torch.no_grad():
                ours = token_logprobs(model, ids)
        else:
            ours = pipelined_token_logprobs(model, ids, micro_batch_size=1)
        if ours is not None:
            results[f"{label}_logprob_diff"] = float((ours - reference_logprobs(hf, ids))
                                                     .abs().max())
        teardown_parallel()
        master_port += 1
    return results


def _cp_grad_diff(model: Any, hf: Any, ids: Any, ours: Any) -> float:
    """Max relative difference of the attention down projections' gradients of the summed
    log-probs (each CP rank's part, summed over CP) from Hugging Face's."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ours.sum().backward()
    logits = hf(ids).logits
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])
    lp.sum().backward()
    worst = 0.0
    for i, layer in enumerate(model.decoder.layers):
        att = layer.self_attention
        for mine, theirs in ((att.linear_kv_down_proj, "kv_a_proj_with_mqa"),
                             (att.linear_q_down_proj, "q_a_proj")):
            grad = mine.weight.grad.clone()
            dist.all_reduce(grad, group=ps.get_context_parallel_group())
            ref = getattr(hf.model.layers[i].self_attn, theirs).weight.grad
            worst = max(worst, float((grad - ref).abs().max() / ref.abs().max()))
    return worst


@pytest.mark.slow
def test_two_ranks_match_hf_and_round_trip() -> None:
    results = run_ranks(Path(__file__), "mla_worker", 2)
    for label in ("tp2", "sp2", "ep2", "pp2", "cp2"):
        for rank_results in results:
            assert rank_results[f"{label}_round_trip"] == [], label
            got, want = rank_results[f"{label}_num_tensors"]
            assert got == want, label
        diffs = [r[f"{label}_logprob_diff"] for r in results if f"{label}_logprob_diff" in r]
        assert diffs and max(diffs) < 1e-4, (label, diffs)
    assert max(r["cp2_grad_diff"] for r in results) < 1e-4
