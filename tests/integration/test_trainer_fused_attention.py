"""The fused attention backend against megatron's local spec on two gloo ranks: the same
log-probs and gradients (fp32) at TP 1 (DP 2), TP 2, TP 2 with sequence parallelism, CP 2,
PP 2 and EP 2 (an MoE model); packed rows (THD) equal the same rows run one by one under
TP 2 with sequence parallelism, and so do two rows sharing a prefix run as one shared-prefix
row; activation recomputation changes no gradient."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.testing.trainer_ranks import run_ranks

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp1": {}, "tp2": {"tensor_parallel": 2},
    "sp": {"tensor_parallel": 2, "sequence_parallel": True}, "cp2": {"context_parallel": 2},
    "pp2": {"pipeline_parallel": 2}, "ep2": {"expert_parallel": 2},
}  # fmt: skip


def _run(model: Any, layout: str, ids: Any, weights: Any, cu: list[int] | None = None,
         prefix_of: list[int] | None = None) -> Any:
    """Log-probs of `ids` (None before the last pipeline stage) after backward of a weighted
    sum of them, the gradients made whole across ranks as the policy's step does."""
    import torch

    from services.trainer.attention.context_parallel import cp_token_logprobs
    from services.trainer.data.batch import MicroBatch
    from services.trainer.objective.logprobs import token_logprobs
    from services.trainer.optim.grad_norm import all_reduce_data_parallel_grads
    from services.trainer.pipeline_step import run_schedule

    if layout == "pp2":
        zeros = torch.zeros(ids.shape)
        mb = MicroBatch(ids, zeros + 1, zeros, zeros, [ids.shape[1]] * ids.shape[0])
        seen: list[Any] = []

        def on_logprobs(_: Any, logprobs: Any) -> Any:
            seen.append(logprobs.detach())
            return (logprobs * weights).sum(), torch.tensor(1, dtype=torch.int), {}

        run_schedule(model, [mb], on_logprobs, forward_only=False)
        all_reduce_data_parallel_grads(list(model.parameters()))
        return seen[0] if seen else None
    fn = cp_token_logprobs if layout == "cp2" else token_logprobs
    if prefix_of is not None:
        logprobs = fn(model, ids, cu_seqlens=cu, prefix_of=prefix_of)
    else:
        logprobs = fn(model, ids, cu_seqlens=cu) if cu is not None else fn(model, ids)
    (logprobs * weights).sum().backward()
    all_reduce_data_parallel_grads(list(model.parameters()))
    return logprobs.detach()


def _shared_prefix_diffs(model: Any, ids: Any, weights: Any) -> dict[str, float]:
    """Two rows sharing their first 8 tokens, whole, against one shared-prefix row (the first
    7 once, then each row's rest attending to them): log-probs and gradients of the tokens
    after the shared part."""
    import torch

    rows = torch.stack([ids[0], torch.cat([ids[0, :8], ids[1, 8:]])])
    tail = torch.zeros_like(weights)
    tail[:, 8:] = weights[:, 8:]
    model.zero_grad()
    whole = _run(model, "sp", rows, tail)
    whole_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    row = torch.cat([rows[0, :7], rows[0, 7:], rows[1, 7:]])[None]
    shared = _run(model, "sp", row, torch.cat([tail[0, :7], tail[0, 7:], tail[1, 7:]])[None],
                  [0, 7, 19, 31], [-1, 0, 0])  # fmt: skip
    got = torch.stack([shared[0, 8:19], shared[0, 20:31]])
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"sp_shared_prefix_diff": float((got - whole[:, 8:]).abs().max()),
            "sp_shared_prefix_grad_diff": max(float((grads[n] - g).abs().max() / g.abs().max())
                                              for n, g in whole_grads.items())}  # fmt: skip


def fused_worker(rank: int, world_size: int, master_port: int) -> dict[str, Any]:
    import torch

    from services.testing.hf_models import random_hf_model
    from services.trainer.model.model import ModelShape, build_gpt_model
    from services.trainer.model_config import ParallelConfig
    from services.trainer.parallel.parallel import init_parallel, teardown_parallel
    from services.trainer.weights.convert import load_hf_weights

    dense = random_hf_model("qwen2", num_layers=2, num_heads=4, num_kv_heads=2)
    moe = random_hf_model("qwen2_moe", num_layers=2)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, 19), generator=gen)
    weights = torch.randn(ids.shape, generator=gen)
    results: dict[str, Any] = {}
    port = master_port
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1}  # fmt: skip
    runs = [(layout, backend, None) for layout in LAYOUTS for backend in ("local", "fused")]
    runs.append(("tp1", "fused", recompute))
    got: dict[tuple[str, str, bool], tuple[Any, dict[str, Any]]] = {}
    for layout, backend, rec in runs:
        port += 1
        parallel = ParallelConfig(**LAYOUTS[layout])
        init_parallel(parallel, rank=rank, world_size=world_size, master_port=port)
        hf = moe if layout == "ep2" else dense
        shape = ModelShape.from_hf(hf.config)
        model = build_gpt_model(shape, sequence_parallel=parallel.sequence_parallel,
                                attention=backend, recompute=rec)  # fmt: skip
        load_hf_weights(model, shape, hf.state_dict())
        logprobs = _run(model, layout, ids, weights)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        got[(layout, backend, rec is not None)] = (logprobs, grads)
        if layout == "sp" and backend == "fused":  # packed rows: one THD row of both
            model.zero_grad()
            flat = _run(model, layout, ids.reshape(1, -1), weights.reshape(1, -1), [0, 19, 38])
            results["sp_packed_diff"] = float((flat.reshape(2, 19) - logprobs).abs().max())
            packed_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            results["sp_packed_grad_diff"] = max(
                float((packed_grads[n] - g).abs().max() / g.abs().max()) for n, g in grads.items()
            )
            results.update(_shared_prefix_diffs(model, ids, weights))
        teardown_parallel()
    for layout in LAYOUTS:
        (lp_local, g_local), (lp_fused, g_fused) = got[(layout, "local", False)], got[
            (layout, "fused", False)]  # fmt: skip
        if lp_local is not None:
            results[f"{layout}_logprob_diff"] = float((lp_local - lp_fused).abs().max())
        assert g_local.keys() == g_fused.keys() and g_local, layout
        results[f"{layout}_grad_diff"] = max(
            float((g_local[n] - g_fused[n]).abs().max() / g_local[n].abs().max()) for n in g_local
        )
    (_, plain), (_, recomputed) = got[("tp1", "fused", False)], got[("tp1", "fused", True)]
    results["recompute_grad_diff"] = max(float((plain[n] - recomputed[n]).abs().max())
                                         for n in plain)  # fmt: skip
    return results


@pytest.mark.slow
def test_fused_attention_equals_local_spec_in_every_layout() -> None:
    results = run_ranks(Path(__file__), "fused_worker", 2)
    for rank, r in enumerate(results):
        print(rank, r)
        for layout in LAYOUTS:
            if f"{layout}_logprob_diff" in r:
                assert r[f"{layout}_logprob_diff"] < 1e-5, (rank, layout)
            assert r[f"{layout}_grad_diff"] < 1e-5, (rank, layout)
        assert "pp2_logprob_diff" in r or rank == 0  # the last stage scored the rows
        assert r["sp_packed_diff"] < 1e-5 and r["sp_packed_grad_diff"] < 1e-5, rank
        assert r["sp_shared_prefix_diff"] < 1e-5, rank
        assert r["sp_shared_prefix_grad_diff"] < 1e-5, rank
        assert r["recompute_grad_diff"] == 0.0, rank
