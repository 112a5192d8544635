"""One trainer step on a rollout batch: anchor log-probs, then clipped-PG optimizer updates.

At the start of the step the policy's log-probs of every micro-batch are taken without grad
(the "old" policy of the PPO ratio and the numerator of the TIS weight against the engine's
rollout log-probs). The batch is then split into `num_minibatches` optimizer updates; within
one, micro-batch losses are weighted by their share of loss tokens, so the gradient is that
of the token mean over the whole minibatch. Called by loop.py.
"""

from __future__ import annotations

import torch

from services.trainer.batch import MicroBatch, RolloutBatch
from services.trainer.loss import LossSettings, policy_loss
from services.trainer.policy import LogprobSource, Policy


def _split(items: list[MicroBatch], parts: int) -> list[list[MicroBatch]]:
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def train_step(
    policy: Policy,
    batch: RolloutBatch,
    settings: LossSettings,
    num_minibatches: int = 1,
    reference: LogprobSource | None = None,
) -> dict[str, float]:
    """Run the optimizer updates of one rollout batch; returns token-weighted mean metrics."""
    with torch.no_grad():
        old = {id(mb): policy.logprobs(mb).detach() for mb in batch.micro_batches}
        ref = (
            {id(mb): reference.logprobs(mb).detach() for mb in batch.micro_batches}
            if reference is not None
            else {}
        )
    sums: dict[str, float] = {}
    total_tokens = 0
    for minibatch in _split(batch.micro_batches, num_minibatches):
        tokens = sum(mb.num_loss_tokens for mb in minibatch)
        if tokens == 0:
            continue
        for mb in minibatch:
            n = mb.num_loss_tokens
            if n == 0:
                continue
            loss, metrics = policy_loss(
                policy.logprobs(mb), old[id(mb)], mb.rollout_logprobs, mb.advantages,
                mb.loss_mask, settings, ref.get(id(mb)),
            )  # fmt: skip
            policy.backward(loss * (n / tokens))
            metrics["loss"] = loss.detach()
            for key, value in metrics.items():
                if key != "num_loss_tokens":
                    sums[key] = sums.get(key, 0.0) + float(value) * n
            total_tokens += n
        for key, step_value in policy.step().items():
            sums[key] = sums.get(key, 0.0) + step_value * tokens
    out = {key: value / max(total_tokens, 1) for key, value in sums.items()}
    out["num_loss_tokens"] = float(total_tokens)
    return out
