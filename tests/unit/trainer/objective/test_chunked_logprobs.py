"""Chunked log-probs equal log_softmax(logits / T) gathered, with the same gradients."""

from __future__ import annotations

import pytest
import torch

from services.trainer.objective.chunked_logprobs import target_logprobs
from services.trainer.objective.logprobs import token_logprobs_from_logits


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.8, 1.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_grads_at_temperature_equal_log_softmax(
    temperature: float, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(2, 9, 50, generator=gen)).to(dtype)
    targets = torch.randint(0, 50, (2, 9), generator=gen)
    weights = torch.randn(2, 9, generator=gen)
    ours_in = logits.clone().requires_grad_(True)
    ref_in = logits.clone().requires_grad_(True)
    ours = target_logprobs(ours_in, targets, temperature, chunk_tokens=4)  # chunks of 4 tokens
    ref = _reference(ref_in, targets, temperature)
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-6)
    assert ours_in.grad is not None and ours_in.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=tol, rtol=tol)


def test_temperature_changes_the_distribution() -> None:
    """The control: log-probs at T = 0.8 differ from those at T = 1 (so the tests above
    would see a temperature that is not applied)."""
    logits = 3 * torch.randn(1, 6, 20, generator=torch.Generator().manual_seed(1))
    targets = torch.zeros(1, 6, dtype=torch.long)
    gap = target_logprobs(logits, targets, 0.8) - target_logprobs(logits, targets)
    assert gap.abs().max() > 1e-2


def test_token_alignment_zeroes_each_sequence_start() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 8, 30, generator=gen)
    ids = torch.randint(0, 30, (1, 8), generator=gen)
    padded = token_logprobs_from_logits(logits, ids, 0.8)
    want = _reference(logits[:, :-1], ids[:, 1:], 0.8)
    torch.testing.assert_close(padded[:, 1:], want, atol=1e-6, rtol=0)
    assert padded[0, 0] == 0
    packed = token_logprobs_from_logits(logits, ids, 0.8, cu_seqlens=[0, 3, 8])
    assert packed[0, 0] == 0 and packed[0, 3] == 0
    torch.testing.assert_close(packed[0, 4:], padded[0, 4:], atol=0, rtol=0)


def test_rejects_non_positive_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        target_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0.0)
