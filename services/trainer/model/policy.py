"""The model the trainer optimises, behind a small interface the loop and step use.

`Policy` is what step.py needs: per-token log-probs of a micro-batch, backward, an optimizer
step, and save/load for checkpoints. `ModelPolicy` implements it for any torch module plus a
log-prob function (the megatron GPT model with `logprobs.token_logprobs`, or a tiny torch LM
in tests), with `MasterAdam` as the optimizer (state in memory or streamed from disk).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from services.trainer.data.batch import MicroBatch
from services.trainer.model.routing_replay import RoutingReplay
from services.trainer.optim.optimizer_shard import CombinedOptimizer
from services.trainer.optim.optimizer_stream import MasterAdam

#: (model, input_ids) -> per-token log-probs; called with `cu_seqlens=` for packed rows (and
#: `prefix_of=` where they share prefixes).
LogprobFn = Callable[..., Tensor]
#: Clips the gradients of the given params to a max norm in place; returns the norm before.
ClipFn = Callable[[list[Tensor], float], float]
#: Makes the gradients of the given params complete across ranks (data-parallel all-reduce).
GradSyncFn = Callable[[list[Tensor]], None]
MODEL_FILE = "model.pt"


class LogprobSource(Protocol):
    """Anything that scores a micro-batch: the policy, or a frozen reference model."""

    def logprobs(self, batch: MicroBatch) -> Tensor:
        """Per-token log-probs `[B, T]` aligned with `batch.input_ids` (0 at position 0)."""
        ...


class Policy(LogprobSource, Protocol):
    """A trainable policy: log-probs with grad, backward, optimizer step, checkpoint I/O."""

    def backward(self, loss: Tensor) -> None:
        """Accumulate gradients of `loss`."""
        ...

    def step(self) -> dict[str, float]:
        """Clip, apply and clear the accumulated gradients; returns metrics (grad_norm)."""
        ...

    def save(self, directory: Path) -> None:
        """Write model and optimizer state into an existing directory."""
        ...

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote."""
        ...


def causal_lm_logprobs(model: Any, input_ids: Tensor) -> Tensor:
    """Token log-probs from a module mapping ids `[B, T]` to logits `[B, T, V]`."""
    logits = model(input_ids).float()
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    out[:, 1:] = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return out


def logprob_keywords(batch: MicroBatch, temperature: float,
                     loss_tokens_only: bool = False) -> dict[str, Any]:  # fmt: skip
    """The log-prob function's keywords: a packed micro-batch's boundaries (and shared
    prefixes), a sampling temperature other than 1 (functions for padded rows at T = 1
    need neither) and, with `loss_tokens_only`, the loss mask as `scored`."""
    out: dict[str, Any] = {} if batch.cu_seqlens is None else {"cu_seqlens": batch.cu_seqlens}
    if batch.prefix_of is not None:
        out["prefix_of"] = batch.prefix_of
    if temperature != 1.0:
        out["temperature"] = temperature
    if loss_tokens_only:
        out["scored"] = batch.loss_mask
    return out


def _clip_local(params: list[Tensor], max_norm: float) -> float:
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


class FrozenModel:
    """A model scored without gradients, e.g. the reference of the KL term."""

    def __init__(
        self, model: torch.nn.Module, logprob_fn: LogprobFn = causal_lm_logprobs,
        temperature: float = 1.0, loss_tokens_only: bool = False,
    ) -> None:
        self.model = model.requires_grad_(False)
        self.logprob_fn = logprob_fn
        self.temperature = temperature  # the engines' sampling temperature
        self.loss_tokens_only = loss_tokens_only  # see ModelPolicy

    def logprobs(self, batch: MicroBatch) -> Tensor:
        keywords = logprob_keywords(batch, self.temperature, self.loss_tokens_only)
        with torch.no_grad():
            return self.logprob_fn(self.model, batch.input_ids, **keywords)


class ModelPolicy:
    """A torch module, its log-prob function and a MasterAdam optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: MasterAdam | CombinedOptimizer,
        logprob_fn: LogprobFn = causal_lm_logprobs,
        max_grad_norm: float | None = 1.0,
        clip_fn: ClipFn | None = None,
        grad_sync: GradSyncFn | None = None,
        temperature: float = 1.0,
        routing_replay: RoutingReplay | None = None,
        loss_tokens_only: bool = False,
    ) -> None:
        self.model = model
        #: the log-prob function takes `scored=` (the loss mask) and scores only those
        #: tokens (logprobs.token_logprobs); every use of the log-probs is masked by it
        self.loss_tokens_only = loss_tokens_only
        self.routing_replay = routing_replay  # MoE: route by the engine's routed experts
        self.temperature = temperature  # the engines' sampling temperature
        self.optimizer = optimizer
        self.logprob_fn = logprob_fn
        self.max_grad_norm = max_grad_norm
        self.clip_fn = clip_fn or _clip_local
        self.grad_sync = grad_sync

    def logprobs(self, batch: MicroBatch) -> Tensor:
        if self.routing_replay is not None:
            self.routing_replay.set_routes(batch.routed_experts, batch.lengths, batch.cu_seqlens)
        return self.logprob_fn(self.model, batch.input_ids,
                               **logprob_keywords(batch, self.temperature, self.loss_tokens_only))

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def step(self) -> dict[str, float]:
        if self.grad_sync is not None:
            self.grad_sync(self.optimizer.params)
        params = [p for p in self.optimizer.params if p.grad is not None]
        norm = self.clip_fn(
            params, self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        )
        self.optimizer.step()
        self.optimizer.zero_grad()
        return {"grad_norm": norm}

    def save(self, directory: Path) -> None:
        torch.save(self.model.state_dict(), directory / MODEL_FILE)
        optimizer_dir = directory / "optimizer"
        optimizer_dir.mkdir()
        self.optimizer.save(optimizer_dir)

    def load(self, directory: Path) -> None:
        state = torch.load(directory / MODEL_FILE, weights_only=True)
        self.model.load_state_dict(state)
        # The master weights are the source of truth; load() copies them into the params.
        self.optimizer.load(directory / "optimizer")
