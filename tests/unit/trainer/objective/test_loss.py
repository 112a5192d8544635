"""Loss tests on hand-computed examples: advantages, clipping, masking, TIS, KL metrics."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.objective.loss import (
    LossSettings,
    group_advantages,
    mismatch_kl,
    policy_loss,
    truncated_is_weights,
)


def test_group_advantages_mean_and_std() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    raw = group_advantages(rewards, normalize_std=False)
    assert torch.equal(raw, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    # Group 0: population std 0.5 -> +-1; group 1: std 0 -> all zero, not NaN.
    norm = group_advantages(rewards, normalize_std=True, eps=0.0 + 1e-6)
    assert torch.allclose(norm[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(norm[1], torch.zeros(4))


def test_group_advantages_rejects_flat_rewards() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.ones(4))


def _tensors(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def test_on_policy_loss_is_minus_mean_advantage_over_masked_tokens() -> None:
    lp = _tensors([0.0, -1.0, -2.0, -3.0])
    adv = _tensors([9.0, 1.0, 1.0, -2.0])
    mask = _tensors([0, 1, 1, 1])  # the prompt token (advantage 9) must not count
    loss, m = policy_loss(lp, lp, lp, adv, mask, LossSettings())
    assert loss.item() == pytest.approx(-(1 + 1 - 2) / 3)
    assert m["clip_frac"].item() == 0.0
    assert m["tis_clip_frac"].item() == 0.0
    assert m["mismatch_kl"].item() == 0.0
    assert m["num_loss_tokens"].item() == 3


def test_ppo_clipping_hand_computed() -> None:
    old = _tensors([0.0, 0.0, 0.0, 0.0])
    # ratios 1.5, 0.5, 1.5, 0.5 against eps 0.2 / 0.2
    lp = torch.log(_tensors([1.5, 0.5, 1.5, 0.5])).requires_grad_(True)
    adv = _tensors([1.0, 1.0, -1.0, -1.0])
    mask = _tensors([1, 1, 1, 1])
    loss, m = policy_loss(lp, old, old, adv, mask, LossSettings(0.2, 0.2, None))
    # per token max(-A r, -A clip(r)): -1.2 (clipped high), -0.5, 1.5, 0.8 (clipped low)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    assert m["clip_frac_high"].item() == pytest.approx(0.25)
    assert m["clip_frac_low"].item() == pytest.approx(0.25)
    loss.backward()
    # d/dlp of -A r / 4 = -A r / 4 where unclipped; 0 where the clipped branch wins
    expected = torch.tensor([[0.0, -0.5 / 4, 1.5 / 4, 0.0]])
    assert torch.allclose(lp.grad, expected, atol=1e-6)


def test_asymmetric_clip_high() -> None:
    old = _tensors([0.0])
    lp = torch.log(_tensors([1.25]))
    adv, mask = _tensors([1.0]), _tensors([1])
    loss, m = policy_loss(lp, old, old, adv, mask, LossSettings(0.2, 0.28, None))
    assert loss.item() == pytest.approx(-1.25)  # inside the wider upper clip
    assert m["clip_frac"].item() == 0.0


def test_truncated_importance_sampling_weights_and_loss() -> None:
    old = _tensors([0.0, 0.0, 0.0])
    rollout = torch.log(_tensors([0.5, 0.25, 2.0]))  # weights old/rollout = 2, 4, 0.5
    weights, capped = truncated_is_weights(old, rollout, cap=3.0)
    assert torch.allclose(weights, _tensors([2.0, 3.0, 0.5]))
    assert capped.tolist() == [[False, True, False]]
    lp = old.clone().requires_grad_(True)
    adv, mask = _tensors([1.0, 1.0, 1.0]), _tensors([1, 1, 0])
    loss, m = policy_loss(lp, old, rollout, adv, mask, LossSettings(0.2, 0.2, 3.0))
    assert loss.item() == pytest.approx(-(2.0 + 3.0) / 2)  # third token masked out
    assert m["tis_clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.0, -1.5, 0.0]]))
    uncapped, _ = truncated_is_weights(old, rollout, cap=None)
    assert torch.allclose(uncapped, _tensors([2.0, 4.0, 0.5]))


def test_masked_tokens_have_no_gradient_and_no_metric_effect() -> None:
    old = _tensors([0.0, 0.0])
    lp = torch.log(_tensors([1.0, 5.0])).requires_grad_(True)
    rollout = torch.log(_tensors([1.0, 0.01]))
    adv, mask = _tensors([1.0, 100.0]), _tensors([1, 0])
    loss, m = policy_loss(lp, old, rollout, adv, mask, LossSettings())
    loss.backward()
    assert lp.grad[0, 1].item() == 0.0
    assert m["clip_frac"].item() == 0.0 and m["tis_clip_frac"].item() == 0.0
    assert m["mismatch_kl"].item() == 0.0


def test_mismatch_kl_hand_computed() -> None:
    old = _tensors([math.log(0.5), math.log(0.2)])
    rollout = _tensors([math.log(0.25), math.log(0.2)])
    m = mismatch_kl(old, rollout, _tensors([1, 1]))
    # token 0: r = 2, k3 = 2 - 1 - ln 2; k1 = -ln 2; token 1: zero
    assert m["mismatch_kl"].item() == pytest.approx((1 - math.log(2)) / 2)
    assert m["mismatch_kl_k1"].item() == pytest.approx(-math.log(2) / 2)


def test_reference_kl_term() -> None:
    lp = _tensors([math.log(0.5)]).requires_grad_(True)
    ref = _tensors([math.log(0.25)])
    zero = _tensors([0.0])
    settings = LossSettings(tis_cap=None, kl_coef=0.1)
    loss, m = policy_loss(lp, lp.detach(), lp.detach(), zero, _tensors([1]), settings, ref)
    k3 = 0.5 - 1 - math.log(0.5)  # r = ref/p = 0.5
    assert m["ref_kl"].item() == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.1 * k3)
