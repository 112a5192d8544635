"""One trainer step on a rollout batch: anchor log-probs, then clipped-PG optimizer updates.

At the start of the step the policy's log-probs of every micro-batch are taken without grad
(the "old" policy of the PPO ratio and the numerator of the TIS weight against the engine's
rollout log-probs); with a single optimizer update the weights do not move before every
micro-batch's training forward, so the old log-probs are that forward's, detached, and no
extra forward runs (`anchors_from_training_forward`). The batch is then split into
`num_minibatches` optimizer updates; within one, micro-batch losses are weighted by their
share of loss tokens, so the gradient is that of the token mean over the whole minibatch.
With data parallelism every rank gets the whole batch and trains every `size`-th
micro-batch of each minibatch (the policy sums the gradients over the DP group before its
optimizer step); the metrics are summed over the group. With expert parallelism the ranks
run in lockstep (lockstep.py): as many micro-batches each, of equal shapes, padded with
loss-free rows and dummies, including those without loss tokens.
Called by loop.py and worker.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.trainer.data.batch import MicroBatch, RolloutBatch
from services.trainer.data.lockstep import lockstep_share
from services.trainer.model.policy import LogprobSource, Policy
from services.trainer.objective.loss import LossSettings, policy_loss


def _split(items: list[MicroBatch], parts: int) -> list[list[MicroBatch]]:
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


@dataclass(frozen=True)
class DataShard:
    """This rank's share of each batch under data parallelism."""

    rank: int
    size: int
    group: Any  # the data-parallel process group
    lockstep: bool = False  # every rank runs as many equally shaped micro-batches (EP > 1)

    def pick(self, items: list[MicroBatch]) -> list[MicroBatch]:
        if self.lockstep:
            return lockstep_share(items, self.rank, self.size)
        return items[self.rank :: self.size]

    def sum(self, sums: dict[str, float]) -> dict[str, float]:
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, sums, group=self.group)
        out: dict[str, float] = {}
        for part in gathered:
            for key, value in part.items():
                out[key] = out.get(key, 0.0) + value
        return out


#: Each optimizer update of a step: (loss tokens of the whole minibatch, this rank's part).
StepPlan = list[tuple[int, list[MicroBatch]]]


def plan_step(
    batch: RolloutBatch, num_minibatches: int, shard: DataShard | None = None
) -> StepPlan:
    """The minibatches of `batch` that carry loss, with this rank's micro-batches of each
    (loss-free ones only under lockstep, where every rank must run as many)."""
    lockstep = shard is not None and shard.lockstep
    plan = []
    for minibatch in _split(batch.micro_batches, num_minibatches):
        tokens = sum(mb.num_loss_tokens for mb in minibatch)
        if tokens > 0:
            picked = shard.pick(minibatch) if shard is not None else minibatch
            plan.append((tokens, [mb for mb in picked if mb.num_loss_tokens > 0 or lockstep]))
    return plan


def add_weighted(sums: dict[str, Any], metrics: dict[str, Any], weight: float) -> None:
    """Accumulate `metrics` (tensors or floats) times `weight` into `sums`; tensors stay on
    their device in float64 (the arithmetic of Python floats) until `settle`, so the step
    never waits for the GPU between micro-batches."""
    for key, value in metrics.items():
        if key != "num_loss_tokens":
            term = value.detach().double() * weight if torch.is_tensor(value) else value * weight
            sums[key] = sums.get(key, 0.0) + term


def settle(sums: dict[str, Any]) -> dict[str, float]:
    """`add_weighted`'s sums as Python floats."""
    return {key: float(value) for key, value in sums.items()}


def step_metrics(
    sums: dict[str, float], step_sums: dict[str, float], plan: StepPlan
) -> dict[str, float]:
    """Token-weighted means of the micro-batch sums (already summed over ranks) and of the
    optimizer updates' metrics, plus the step's loss tokens."""
    total_tokens = sum(tokens for tokens, _ in plan)
    out = {key: value / max(total_tokens, 1) for key, value in {**sums, **step_sums}.items()}
    out["num_loss_tokens"] = float(total_tokens)
    return out


def anchors_from_training_forward(plan: StepPlan) -> bool:
    """Whether the "old" log-probs are the detached ones of the training forward: one
    optimizer update, so no micro-batch is scored after the weights move."""
    return len(plan) == 1


def train_step(
    policy: Policy,
    batch: RolloutBatch,
    settings: LossSettings,
    num_minibatches: int = 1,
    reference: LogprobSource | None = None,
    shard: DataShard | None = None,
) -> dict[str, float]:
    """Run the optimizer updates of one rollout batch; returns token-weighted mean metrics."""
    plan = plan_step(batch, num_minibatches, shard)
    scheduled = [mb for _, part in plan for mb in part]
    single = anchors_from_training_forward(plan)
    with torch.no_grad():
        old = {} if single else {id(mb): policy.logprobs(mb).detach() for mb in scheduled}
        ref = (
            {id(mb): reference.logprobs(mb).detach() for mb in scheduled}
            if reference is not None
            else {}
        )
    sums: dict[str, Any] = {}
    step_sums: dict[str, Any] = {}
    for tokens, part in plan:
        for mb in part:
            n = mb.num_loss_tokens
            logprobs = policy.logprobs(mb)
            loss, metrics = policy_loss(
                logprobs, logprobs.detach() if single else old[id(mb)], mb.rollout_logprobs,
                mb.advantages, mb.loss_mask, settings, ref.get(id(mb)),
            )  # fmt: skip
            policy.backward(loss * (n / tokens))
            metrics["loss"] = loss.detach()
            add_weighted(sums, metrics, n)
        add_weighted(step_sums, policy.step(), tokens)  # the same on every rank
    sums = settle(sums)
    if shard is not None:
        sums = shard.sum(sums)
    return {**step_metrics(sums, settle(step_sums), plan), **replay_counts(policy, shard),
            **cuda_peak_memory()}


def cuda_peak_memory() -> dict[str, float]:
    """This rank's peak GPU memory so far (what its allocator reserved), in GiB; nothing on
    CPU."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {"cuda_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def replay_counts(policy: Policy, shard: DataShard | None) -> dict[str, float]:
    """The step's routing-replay token counts (replayed, fell back), summed over the ranks;
    nothing when the policy does not replay."""
    replay = getattr(policy, "routing_replay", None)
    if replay is None:
        return {}
    counts = replay.take_counts()
    out = {"routing_replay_tokens": float(counts.replayed_tokens),
           "routing_replay_fallback_tokens": float(counts.fallback_tokens)}
    return shard.sum(out) if shard is not None else out
