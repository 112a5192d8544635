"""The fused output layer + log-prob on two gloo ranks: under TP 2 and TP 2 with sequence
parallelism (padded and packed rows, tied and untied output weights) the log-probs and every
gradient equal those of logits then chunked log-probs (fp32, chunks smaller than a row), and
so do those of the loss tokens alone (`scored`) against the whole row's, masked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.testing.trainer_ranks import run_ranks


def fused_output_worker(rank: int, world_size: int, master_port: int) -> dict[str, float]:
    import torch

    from services.testing.hf_models import random_hf_model
    from services.trainer.model.model import ModelShape, build_gpt_model
    from services.trainer.model_config import ParallelConfig
    from services.trainer.objective import fused_output
    from services.trainer.objective.logprobs import token_logprobs
    from services.trainer.parallel.parallel import init_parallel, teardown_parallel
    from services.trainer.weights.convert import load_hf_weights

    fused_output.DEFAULT_CHUNK_TOKENS = 7  # several chunks per row
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (2, 19), generator=gen)
    weights = torch.randn(ids.shape, generator=gen)
    mask = (torch.rand(ids.shape, generator=gen) > 0.6).float()  # the loss tokens
    results: dict[str, float] = {}
    port = master_port
    for sp in (False, True):
        for tied in (False, True):
            port += 1
            init_parallel(ParallelConfig(tensor_parallel=2, sequence_parallel=sp), rank=rank,
                          world_size=world_size, master_port=port)  # fmt: skip
            hf = random_hf_model("qwen2", num_layers=2, num_heads=4, num_kv_heads=2,
                                 tie_word_embeddings=tied)  # fmt: skip
            shape = ModelShape.from_hf(hf.config)
            model = build_gpt_model(shape, sequence_parallel=sp)
            load_hf_weights(model, shape, hf.state_dict())
            for rows, cu in ((ids, None), (ids.reshape(1, -1), [0, 19, 38])):
                runs: list[Any] = []
                for fused in (False, True):
                    model.zero_grad()
                    lp = token_logprobs(model, rows, 0.8, cu, fused=fused)
                    (lp * weights.reshape(rows.shape)).sum().backward()
                    runs.append((lp.detach(), {n: p.grad.clone()
                                               for n, p in model.named_parameters()}))  # fmt: skip
                # the loss tokens alone: the fused layer's rows picked out of the gathered
                # hidden states, the same on every rank
                model.zero_grad()
                scored = mask.reshape(rows.shape)
                lp = token_logprobs(model, rows, 0.8, cu, fused=True, scored=scored)
                (lp * weights.reshape(rows.shape) * scored).sum().backward()
                scored_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                model.zero_grad()
                whole = token_logprobs(model, rows, 0.8, cu, fused=False)
                (whole * weights.reshape(rows.shape) * scored).sum().backward()
                (want, want_g), (got, got_g) = runs
                key = f"{'sp' if sp else 'tp2'}_{'tied' if tied else 'untied'}_{cu is not None}"
                results[f"{key}_logprob_diff"] = float((got - want).abs().max())
                results[f"{key}_grad_diff"] = max(
                    float((got_g[n] - g).abs().max() / g.abs().max()) for n, g in want_g.items()
                )
                results[f"{key}_scored_logprob_diff"] = float(
                    (lp.detach() - whole.detach() * scored).abs().max())
                results[f"{key}_scored_grad_diff"] = max(
                    float((scored_grads[n] - p.grad).abs().max() / p.grad.abs().max())
                    for n, p in model.named_parameters())
            teardown_parallel()
    return results


@pytest.mark.slow
def test_fused_output_equals_unfused_under_tp_and_sp() -> None:
    results = run_ranks(Path(__file__), "fused_output_worker", 2)
    for rank, r in enumerate(results):
        print(rank, r)
        assert len(r) == 32, rank
        for key, value in r.items():
            assert value < 1e-5, (rank, key, value)
