"""Routing replay in the trainer: routes travel from trajectories into micro-batches (padded,
packed, shared prefixes, lockstep padding), and a router hook replays them where present,
routing by itself (counted) where not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services._proto.riptide.v1.common_pb2 import (
    VERDICT_STATUS_SCORED,
    Group,
    Trajectory,
    TrajectorySegment,
)
from services.common.errors import InvalidRequest
from services.common.routed_experts import pack_routes
from services.trainer.data.batch import pack_groups
from services.trainer.data.lockstep import pad_micro_batch
from services.trainer.model.routing_replay import (
    ReplayCounts,
    RouteReplay,
    RoutingReplay,
    _needed_mask,
)

LAYERS, TOP_K = 2, 2


def _routes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, (n, LAYERS, TOP_K))


def _sample(prompt: list[int], response: list[int], routes: np.ndarray | None,
            reward: float) -> Trajectory:
    n = len(prompt) + len(response)
    packed, present = pack_routes(n, [] if routes is None else [(0, routes)])
    return Trajectory(prompt_ids=prompt, response_ids=response, loss_mask=[1] * len(response),
                      rollout_logprobs=[-1.0] * len(response), reward=reward,
                      status=VERDICT_STATUS_SCORED, routed_experts=packed,
                      routed_experts_present=present, routed_experts_num_layers=LAYERS,
                      routed_experts_top_k=TOP_K)


def test_padded_and_packed_micro_batches_carry_each_tokens_routes() -> None:
    a, b = _routes(5, 0), _routes(3, 1)
    group = Group(group_id="g", samples=[_sample([1, 2], [3, 4, 5], a, 1.0),
                                         _sample([1], [6, 7], None, 0.0),
                                         _sample([9], [8, 7], b[:3], 0.5)])
    (mb,) = pack_groups([("e", group)], False, 100).micro_batches
    routes = mb.routed_experts
    assert routes is not None and routes.shape == (3, 5, LAYERS, TOP_K)
    assert torch.equal(routes[0], torch.from_numpy(a))
    assert (routes[1] == -1).all()  # no routes: the router decides, counted
    assert torch.equal(routes[2, :3], torch.from_numpy(b)) and (routes[2, 3:] == -1).all()
    (packed,) = pack_groups([("e", group)], False, 100, packed=True).micro_batches
    assert packed.routed_experts is not None and packed.routed_experts.shape[:2] == (1, 11)
    assert torch.equal(packed.routed_experts[0, :5], torch.from_numpy(a))
    grown = pad_micro_batch(mb, 4, 7).routed_experts
    assert grown is not None and grown.shape[:2] == (4, 7) and (grown[3] == -1).all()


def _routes_of(ids: list[int]) -> np.ndarray:
    """Routes made from the token ids, so any packing can be checked token by token."""
    t = np.array(ids)[:, None, None]
    return (t + np.arange(LAYERS * TOP_K).reshape(1, LAYERS, TOP_K)) % 8


def test_segments_and_shared_prefixes_keep_their_routes() -> None:
    first = _sample([1, 2, 3], [4, 5, 6], _routes_of([1, 2, 3, 4, 5, 6]), 1.0)
    second = _sample([1, 2, 3], [7, 8, 9], _routes_of([1, 2, 3, 7, 8, 9]), 0.0)
    segmented = _sample([4], [5], _routes_of([4, 5]), 1.0)
    packed, present = pack_routes(3, [(0, _routes_of([9, 2, 3]))])
    segmented.segments.append(TrajectorySegment(
        prompt_ids=[9], response_ids=[2, 3], loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0],
        routed_experts=packed, routed_experts_present=present))
    groups = [("e", Group(group_id="g", samples=[first, second])),
              ("f", Group(group_id="h", samples=[segmented, _sample([4], [6], None, 0.0)]))]
    (mb,) = pack_groups(groups, False, 100, packed=True, shared_prefix=True).micro_batches
    assert mb.prefix_of is not None and max(mb.prefix_of) >= 0  # the prompt is shared
    routes = mb.routed_experts
    assert routes is not None and routes.shape[:2] == mb.input_ids.shape
    ids = mb.input_ids[0].tolist()
    have = (routes[0] >= 0).all(-1).all(-1).numpy()
    assert np.array_equal(routes[0].numpy()[have], _routes_of(ids)[have])
    assert 1 <= (~have).sum() <= 2 and {ids[k] for k in np.flatnonzero(~have)} <= {4, 6}


def test_malformed_routes_name_the_sample() -> None:
    sample = _sample([1], [2, 3], _routes(3, 5), 1.0)
    sample.sample_id, sample.routed_experts_top_k = "s7", 3
    with pytest.raises(InvalidRequest, match="sample s7 of group"):
        pack_groups([("e", Group(group_id="g", samples=[sample]))], False, 100)


def test_the_hook_replays_where_routes_exist_and_routes_itself_elsewhere() -> None:
    hook = RouteReplay(moe_index=0)
    scores = torch.tensor([[0.9, 0.05, 0.03, 0.02], [0.1, 0.2, 0.3, 0.4]])

    def own(s: torch.Tensor, k: int, num_groups: object = None,
            group_topk: object = None) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(s, k, dim=1)

    hook.target = torch.tensor([[2, 3], [-1, -1]])
    probs, ids = hook.get_replay_topk(scores, 2, default_compute_topk=own)
    assert ids.tolist() == [[2, 3], [3, 2]]
    assert torch.allclose(probs, torch.tensor([[0.03, 0.02], [0.4, 0.3]]))
    hook.target = None
    assert hook.get_replay_topk(scores, 2, default_compute_topk=own)[1].tolist() == [[0, 1],
                                                                                      [3, 2]]


def test_counts_cover_every_real_token_but_each_sequences_last() -> None:
    assert _needed_mask([3, 1], False, (2, 4)).tolist() == [[True, True, False, False],
                                                           [False] * 4]
    assert _needed_mask([2, 3], True, (1, 6)).tolist() == [[True, False, True, True, False,
                                                            False]]
    replay = RoutingReplay.__new__(RoutingReplay)  # the counting, without a megatron model
    replay.num_layers, replay.top_k, replay.hooks = LAYERS, TOP_K, []
    replay.counts = ReplayCounts()
    routes = torch.full((2, 4, LAYERS, TOP_K), 1)
    routes[0, 1, 1, 0] = -1  # one layer missing: the token falls back
    with torch.enable_grad():
        replay.set_routes(routes, [3, 2], None)
        replay.set_routes(None, [4], None)
    with torch.no_grad():  # anchor and eval forwards are not counted twice
        replay.set_routes(None, [4], None)
    counts = replay.take_counts()
    assert (counts.replayed_tokens, counts.fallback_tokens) == (2, 1 + 3)


def test_routes_of_another_model_fall_back_counted() -> None:
    replay = RoutingReplay.__new__(RoutingReplay)
    replay.num_layers, replay.top_k, replay.counts = LAYERS, TOP_K, ReplayCounts()
    hook = RouteReplay(0)
    hook.target = torch.zeros(3, TOP_K, dtype=torch.long)
    replay.hooks = [hook]
    with torch.enable_grad():
        replay.set_routes(torch.zeros(1, 3, LAYERS + 1, TOP_K, dtype=torch.long), [3], None)
    assert hook.target is None and replay.take_counts().fallback_tokens == 2


def test_the_step_counts_reach_the_prometheus_counters() -> None:
    from prometheus_client import REGISTRY

    from services.trainer.objective.stats import StepRecord, TrainerStats

    name = "riptide_trainer_routing_replay_fallback_tokens_total"
    before = REGISTRY.get_sample_value(name) or 0.0
    stats = TrainerStats()
    metrics = {"routing_replay_tokens": 90.0, "routing_replay_fallback_tokens": 7.0}
    stats.record(StepRecord(1, 0, 1.0, 0.0, 0.0, 0.0, 1, 2, 100, 0.5, 0.0, 0, metrics))
    assert REGISTRY.get_sample_value(name) == before + 7
