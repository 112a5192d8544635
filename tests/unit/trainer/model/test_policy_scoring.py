"""What the policy asks its log-prob function for: the loss mask as `scored` when it scores
loss tokens only (the megatron policy's default, build_policy), nothing extra otherwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.trainer.data.batch import MicroBatch
from services.trainer.model.policy import FrozenModel, ModelPolicy
from services.trainer.optim.optimizer_stream import MasterAdam


def _batch() -> MicroBatch:
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 1.0]])
    return MicroBatch(torch.arange(6).unsqueeze(0), mask, torch.zeros_like(mask),
                      torch.zeros_like(mask), [6], cu_seqlens=[0, 6])


@pytest.mark.parametrize("loss_tokens_only", [False, True])
def test_the_loss_mask_goes_to_the_logprob_function_only_when_asked(
    loss_tokens_only: bool,
) -> None:
    asked: list[dict[str, Any]] = []

    def logprob_fn(model: Any, ids: torch.Tensor, **keywords: Any) -> torch.Tensor:
        asked.append(keywords)
        return torch.zeros(ids.shape)

    model = torch.nn.Linear(2, 2)
    opt = MasterAdam(list(model.parameters()), lr=1e-3)
    batch = _batch()
    ModelPolicy(model, opt, logprob_fn, temperature=0.8,
                loss_tokens_only=loss_tokens_only).logprobs(batch)
    FrozenModel(torch.nn.Linear(2, 2), logprob_fn, 0.8, loss_tokens_only).logprobs(batch)
    for keywords in asked:
        assert keywords.pop("cu_seqlens") == [0, 6] and keywords.pop("temperature") == 0.8
        if loss_tokens_only:
            assert keywords.pop("scored") is batch.loss_mask
        assert keywords == {}
