"""The RL objective: group-relative advantages and a clipped, importance-corrected PG loss.

Pure torch functions over tensors. Per-token tensors are `[B, T]` and aligned with the token
positions of the packed batch: entry `t` belongs to token `t` (its log-prob given tokens
`< t`); `loss_mask` is 1 on model-generated response tokens and 0 on prompt, observation
and padding tokens, which therefore never contribute to the loss or the metrics.

Three policies meet here: the trainer's current policy (`logprobs`, with grad), the
trainer's policy at the start of the step (`old_logprobs`, the PPO anchor), and the engine
that sampled the tokens (`rollout_logprobs`). The PPO ratio current/old is clipped; the
off-policy gap old/rollout (staleness and train/inference numerics) is corrected with a
truncated importance weight (TIS), which is a constant in the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossSettings:
    """The knobs of `policy_loss` (TrainerConfig.loss holds the configured values)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    tis_cap: float | None = 2.0
    kl_coef: float = 0.0


def group_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages for rewards `[G, n]` (n samples per group): reward minus group mean,
    divided by the group's population std (+eps) when `normalize_std`."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float32)
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (rewards.std(dim=1, keepdim=True, correction=0) + eps)
    return adv


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over positions where `mask` is set (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def truncated_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float | None
) -> tuple[Tensor, Tensor]:
    """Importance weights trainer/engine, truncated at `cap`; returns (weights, capped mask).

    The weights carry no gradient: they reweight samples, they are not optimised.
    """
    weights = torch.exp(old_logprobs.detach() - rollout_logprobs.detach())
    if cap is None:
        return weights, torch.zeros_like(weights, dtype=torch.bool)
    capped = weights > cap
    return weights.clamp(max=cap), capped


def mismatch_kl(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Estimates of KL(engine || trainer) from tokens the engine sampled.

    k1 = mean(log p_engine - log p_trainer) is unbiased but noisy and can be negative;
    k3 = mean(r - 1 - log r), r = p_trainer / p_engine, is unbiased and non-negative.
    """
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    k3 = torch.exp(log_ratio) - 1.0 - log_ratio
    return {"mismatch_kl_k1": masked_mean(-log_ratio, mask), "mismatch_kl": masked_mean(k3, mask)}


def reference_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference), differentiable through `logprobs`."""
    log_ratio = ref_logprobs.detach() - logprobs
    return torch.exp(log_ratio) - 1.0 - log_ratio


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    settings: LossSettings,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-mean clipped policy-gradient loss with TIS correction, and its metrics.

    `advantages` is per token (a sequence's advantage broadcast over its tokens). Returns the
    scalar loss (mean over all masked tokens of the batch) and detached scalar metrics.
    """
    mask = loss_mask.to(torch.bool)
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - settings.clip_eps_low, 1.0 + settings.clip_eps_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    pg = torch.maximum(unclipped, clipped)
    tis, tis_capped = truncated_is_weights(old_logprobs, rollout_logprobs, settings.tis_cap)
    per_token = pg * tis
    if ref_logprobs is not None and settings.kl_coef > 0:
        ref_kl = reference_kl(logprobs, ref_logprobs)
        per_token = per_token + settings.kl_coef * ref_kl
    loss = masked_mean(per_token, mask)

    # A token is clipped when the clamped branch wins (its gradient is then zero).
    clip_active = clipped > unclipped
    with torch.no_grad():
        metrics = {
            "pg_loss": masked_mean(pg * tis, mask),
            "clip_frac": masked_mean(clip_active.float(), mask),
            "clip_frac_low": masked_mean((clip_active & (ratio < low)).float(), mask),
            "clip_frac_high": masked_mean((clip_active & (ratio > high)).float(), mask),
            "tis_clip_frac": masked_mean(tis_capped.float(), mask),
            "tis_weight_mean": masked_mean(tis, mask),
            "ratio_mean": masked_mean(ratio.detach(), mask),
            "num_loss_tokens": mask.sum().to(torch.float32),
            **mismatch_kl(old_logprobs, rollout_logprobs, mask),
        }
        if ref_logprobs is not None:
            metrics["ref_kl"] = masked_mean(reference_kl(logprobs, ref_logprobs), mask)
    return loss, {k: v.detach() for k, v in metrics.items()}
