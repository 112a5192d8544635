"""Rollout Routing Replay (R3): the MoE layers route each token to the experts the engine
routed it to during rollout, so the trainer's log-probs are those of the policy the engine
sampled from even where the two would route differently (kernels, precision, batches).

`install_routing_replay` puts a `RouteReplay` on every megatron TopKRouter of the model, as
megatron's own `router_replay` hook (moe_utils.topk_routing_with_score_function calls its
`get_replay_topk`): the router scores every expert as usual and keeps its auxiliary state
(aux loss, z-loss and expert-bias counts are computed as before, from its own scores), but the
top-k ids come from the micro-batch's `routed_experts` where a token has them; the weights are
the router's probabilities of those ids. A token without routes (-1: the sample carried none,
or the engine never forwarded it) keeps the router's own choice, counted by
`ReplayCounts`. `set_routes` is called with each micro-batch before its forward (policy.py)
and stays in force through its backward, so a recomputed forward replays the same routes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from services.common.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class ReplayCounts:
    """Tokens of the micro-batches scored so far that were replayed or fell back."""

    replayed_tokens: int = 0
    fallback_tokens: int = 0


class RouteReplay:
    """One MoE layer's replay target: `[tokens, top_k]` ids in the router's token order
    ([sequence, batch] flattened), -1 where the token routes by itself."""

    def __init__(self, moe_index: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.moe_index = moe_index
        self.target: Tensor | None = None
        self.last_ids: Tensor | None = None  # the ids the last forward routed by
        self.tp_rank, self.tp_size = tp_rank, tp_size  # sequence parallel: a share of tokens

    def get_replay_topk(
        self, scores: Tensor, topk: int, num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        assert default_compute_topk is not None
        probs, ids = default_compute_topk(scores, topk, num_groups=num_groups,
                                          group_topk=group_topk)
        target = self.target
        if target is None:
            self.last_ids = ids.detach()
            return probs, ids
        if target.shape[0] != scores.shape[0]:  # sequence parallel: this rank's contiguous share
            target = target.chunk(self.tp_size)[self.tp_rank]
        if target.shape != ids.shape:
            raise ValueError(f"MoE layer {self.moe_index}: routes {tuple(target.shape)} for "
                             f"router top-k {tuple(ids.shape)}")
        target = target.to(device=ids.device, dtype=ids.dtype)
        ids = torch.where((target >= 0).all(dim=-1, keepdim=True), target, ids)
        self.last_ids = ids.detach()
        return scores.gather(1, ids), ids


def moe_layer_numbers(shape: Any) -> list[int]:
    """Global 1-based numbers of the model's MoE layers, in order (routes' layer axis)."""
    flags = getattr(shape, "moe_layers", ()) or [shape.is_moe] * shape.num_layers
    return [i + 1 for i, moe in enumerate(flags) if moe]


class RoutingReplay:
    """The replay hooks of one model, set per micro-batch."""

    def __init__(self, model: Any, shape: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        numbers = moe_layer_numbers(shape)
        self.num_layers, self.top_k = len(numbers), shape.moe_topk
        self.counts = ReplayCounts()
        self.hooks: list[RouteReplay] = []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                if module.config.moe_router_fusion:
                    raise ConfigError("routing_replay needs the unfused megatron router")
                tp = _sequence_parallel_share(module.config)
                hook = RouteReplay(numbers.index(module.layer_number), *tp)
                module.router_replay = hook
                self.hooks.append(hook)
        if not self.hooks:
            raise ConfigError("trainer.loss.routing_replay is on but the model has no MoE router")

    def set_routes(self, routes: Tensor | None, lengths: list[int],
                   cu_seqlens: list[int] | None) -> None:
        """Replay `routes` [B, S, moe_layers, top_k] (-1: none) in the next forward; None:
        every token routes by itself. Counts the tokens whose next-token log-prob a route
        shapes: every real token but the last of each sequence."""
        if routes is not None and tuple(routes.shape[2:]) != (self.num_layers, self.top_k):
            log.warning("routes of %s (MoE layers, top-k) for a model of %s: routing by the "
                        "model instead", tuple(routes.shape[2:]), (self.num_layers, self.top_k))
            routes = None
        if routes is None:
            for hook in self.hooks:
                hook.target = None
            if torch.is_grad_enabled():
                self.counts.fallback_tokens += sum(max(n - 1, 0) for n in lengths)
            return
        if torch.is_grad_enabled():  # training forwards only: anchors and evals score again
            missing = (routes < 0).any(dim=-1).any(dim=-1).cpu()  # [B, S]
            mask = _needed_mask(lengths, cu_seqlens is not None, tuple(routes.shape[:2]))
            fallback = int((missing & mask).sum())
            self.counts.fallback_tokens += fallback
            self.counts.replayed_tokens += int(mask.sum()) - fallback
        by_position = routes.transpose(0, 1)  # megatron's [S, B] token order
        for hook in self.hooks:
            layer = by_position[:, :, hook.moe_index]
            hook.target = layer.reshape(-1, self.top_k)

    def take_counts(self) -> ReplayCounts:
        counts, self.counts = self.counts, ReplayCounts()
        return counts


def _sequence_parallel_share(config: Any) -> tuple[int, int]:
    if not config.sequence_parallel:
        return 0, 1
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _needed_mask(lengths: list[int], packed: bool, shape: tuple[int, ...]) -> Tensor:
    """[B, S] True on real tokens but the last of each sequence (a packed row holds the
    sequences back to back, then loss-free padding)."""
    mask = torch.zeros(shape, dtype=torch.bool)
    start = 0
    for row, n in enumerate(lengths):
        if packed:
            mask[0, start : start + n - 1] = True
            start += n
        else:
            mask[row, : max(n - 1, 0)] = True
    return mask
