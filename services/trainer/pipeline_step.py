"""One trainer step under pipeline parallelism: step.py's contract through megatron's 1F1B.

Same inputs, outputs and loss as `step.train_step`: the "old" log-probs are anchored without
grad at the start of the step (a forward-only pipeline pass; with one minibatch, the detached
log-probs of the training forward), the batch is split into
`num_minibatches` optimizer updates, and each micro-batch loss is weighted by its share of
the minibatch's loss tokens; with data parallelism each pipeline trains its DataShard's
micro-batches (in lockstep under EP, loss-free ones included). The policy's optimizer step
makes the gradients whole (grad_norm.py: DP sums, and the last stage's tied embedding copy
summed with the first stage's). Each minibatch runs megatron's forward-backward schedule
once. Micro-batches differ in [B, S], so the stages exchange activation shapes first
(`variable_seq_lengths`), and the loss function returns megatron's 3-tuple under
`calculate_per_token_loss`, so the schedule neither divides the already weighted loss by its
token count nor by the number of micro-batches. Under context parallelism every stage runs
its CP rank's chunks of the rows and the last stage all-gathers the log-probs to whole rows
(logprobs.stage_forward / stage_logprobs), so the loss is the one of CP = 1; the activations
passed between stages are [2 * chunk, B, H]. The loss and its metrics exist on the last
stage only: they are summed over the data-parallel group there and broadcast over the
pipeline group, so every rank (rank 0, the service, is on the first stage) returns what a
one-rank trainer reports.
Called by loop.py and worker.py when pipeline_parallel > 1.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from services.trainer.data.batch import MicroBatch, RolloutBatch
from services.trainer.model.policy import LogprobSource, Policy
from services.trainer.model_config import ParallelConfig
from services.trainer.objective.logprobs import stage_forward, stage_logprobs
from services.trainer.objective.loss import LossSettings, policy_loss
from services.trainer.step import (
    DataShard,
    add_weighted,
    anchors_from_training_forward,
    plan_step,
    settle,
    step_metrics,
)
from services.trainer.step import train_step as one_stage_train_step

#: What the last stage does with one micro-batch's whole-row log-probs [B, S] (megatron's
#: loss_func result).
OnLogprobs = Callable[[MicroBatch, Tensor], Any]
#: step.train_step's signature (policy, batch, settings, num_minibatches, reference, shard).
TrainStepFn = Callable[
    [Policy, RolloutBatch, LossSettings, int, LogprobSource | None, DataShard | None],
    dict[str, float],
]


def _megatron_model(source: object) -> Any:
    model = getattr(source, "model", None)
    if model is None:
        raise TypeError(f"{type(source).__name__} holds no megatron model to pipeline")
    return model


def run_schedule(
    model: Any, micro_batches: list[MicroBatch], on_logprobs: OnLogprobs, forward_only: bool,
    temperature: float = 1.0,
) -> list[Any]:
    """Run megatron's pipeline schedule over `micro_batches` (every stage calls it with the
    same list; under CP each runs its chunks of the rows); the last stage returns what
    `on_logprobs` gave for each (log-probs at the sampling `temperature`), the others []."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    config.variable_seq_lengths = True
    config.calculate_per_token_loss = True

    def forward_step(data: Any, stage_model: Any) -> tuple[Tensor, Any]:
        mb = next(data)
        output, rows = stage_forward(stage_model, mb.input_ids, mb.cu_seqlens)

        def loss_func(logits: Tensor, non_loss_data: bool = False) -> Any:
            logprobs = stage_logprobs(logits, mb.input_ids, rows, temperature, mb.cu_seqlens)
            return on_logprobs(mb, logprobs)

        return output, loss_func

    first = micro_batches[0].input_ids
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=first.shape[1],
        micro_batch_size=first.shape[0],
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )
    return list(out)


def pipelined_logprobs(
    model: Any, micro_batches: list[MicroBatch], temperature: float = 1.0
) -> dict[int, Tensor]:
    """Log-probs of each micro-batch without grad, keyed by id(micro-batch); empty before
    the last stage."""
    if not micro_batches:
        return {}
    with torch.no_grad():
        out = run_schedule(
            model, micro_batches,
            lambda mb, logprobs: logprobs, forward_only=True, temperature=temperature,
        )  # fmt: skip
    return {id(mb): lp.detach() for mb, lp in zip(micro_batches, out, strict=True)} if out else {}


def _to_every_stage(sums: dict[str, float]) -> dict[str, float]:
    from megatron.core import parallel_state as ps

    size = ps.get_pipeline_model_parallel_world_size()
    if size == 1:
        return sums
    box: list[Any] = [sums]
    dist.broadcast_object_list(
        box, group=ps.get_pipeline_model_parallel_group(), group_src=size - 1
    )
    return box[0]  # type: ignore[no-any-return]


def train_step(
    policy: Policy,
    batch: RolloutBatch,
    settings: LossSettings,
    num_minibatches: int = 1,
    reference: LogprobSource | None = None,
    shard: DataShard | None = None,
) -> dict[str, float]:
    """`step.train_step` across pipeline stages; every rank returns the same metrics."""
    model = _megatron_model(policy)
    temperature = float(getattr(policy, "temperature", 1.0))
    plan = plan_step(batch, num_minibatches, shard)
    mine = [mb for _, todo in plan for mb in todo]
    single = anchors_from_training_forward(plan)
    old = {} if single else pipelined_logprobs(model, mine, temperature)
    ref = (pipelined_logprobs(_megatron_model(reference), mine, temperature)
           if reference is not None else {})  # fmt: skip
    sums: dict[str, Any] = {}

    def weighted_loss(mb: MicroBatch, logprobs: Tensor, tokens: int) -> Any:
        n = mb.num_loss_tokens
        loss, metrics = policy_loss(
            logprobs, logprobs.detach() if single else old[id(mb)], mb.rollout_logprobs,
            mb.advantages, mb.loss_mask, settings, ref.get(id(mb)),
        )  # fmt: skip
        metrics["loss"] = loss.detach()
        add_weighted(sums, metrics, n)
        return loss * (n / tokens), torch.tensor(n, dtype=torch.int), {}

    step_sums: dict[str, Any] = {}
    for tokens, todo in plan:
        if todo:
            run_schedule(model, todo, partial(weighted_loss, tokens=tokens), forward_only=False,
                         temperature=temperature)
        add_weighted(step_sums, policy.step(), tokens)  # the same on every rank
    sums = settle(sums)
    if shard is not None:
        sums = shard.sum(sums)
    return step_metrics(_to_every_stage(sums), settle(step_sums), plan)


def train_step_for(parallel: ParallelConfig) -> TrainStepFn:
    """The step function of a layout: this module's with pipeline_parallel > 1, else step.py's."""
    return train_step if parallel.pipeline_parallel > 1 else one_stage_train_step
