"""Decisions of each routing policy, on hand-made targets."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from services.common.errors import ConfigError
from services.router.config import RouterConfig
from services.router.policies import make_policy
from services.router.targets import Engine, Target

POLICIES = ("sticky_min_load", "manual", "consistent_hash", "min_load", "round_robin")


def make_targets(n: int, max_running: int = 0) -> list[Target]:
    return [Target(Engine(url=f"http://e{i}:1", max_running=max_running), 0) for i in range(n)]


def policy(name: str, targets: list[Target], **settings: object):  # type: ignore[no-untyped-def]
    chosen = make_policy(name, RouterConfig(policy=name, **settings))  # type: ignore[arg-type]
    chosen.on_targets_changed(targets)
    return chosen


@pytest.mark.parametrize("name", POLICIES)
def test_contract_picks_only_candidates_and_never_a_draining_one_for_new_sessions(
        name: str) -> None:
    targets = make_targets(4)
    targets[1].draining = True
    p = policy(name, targets)
    candidates = [targets[0], targets[1], targets[3]]  # targets[2] is not routable now
    for i in range(40):
        choice = p.select(f"session-{i}", candidates)
        assert choice is not None
        assert choice.target in (targets[0], targets[3])
    assert p.select("", candidates) is not None  # no session key: still routed


@pytest.mark.parametrize("name", POLICIES)
def test_contract_none_when_every_candidate_drains(name: str) -> None:
    targets = make_targets(2)
    for t in targets:
        t.draining = True
    assert policy(name, targets).select("new-session", targets) is None


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="sticky_min_load"):
        make_policy("cache_aware", RouterConfig())


def test_sticky_first_call_goes_to_least_loaded_then_sticks() -> None:
    targets = make_targets(3)
    targets[0].in_flight, targets[1].in_flight, targets[2].in_flight = 3, 1, 2
    p = policy("sticky_min_load", targets)
    assert p.select("s", targets).target is targets[1]
    targets[1].in_flight = 3  # now the busiest, but below the spill bound
    for _ in range(5):
        choice = p.select("s", targets)
        assert choice.target is targets[1] and not choice.spilled


def test_sticky_new_sessions_balance_active_sessions_not_just_in_flight() -> None:
    targets = make_targets(2)
    p = policy("sticky_min_load", targets)
    first = p.select("a", targets).target
    # "a" is between turns (nothing in flight): the next new session still goes elsewhere.
    assert p.select("b", targets).target is not first


def test_sticky_idle_sessions_stop_counting_but_keep_their_home() -> None:
    targets = make_targets(2)
    p = policy("sticky_min_load", targets, session_idle_s=0.05)
    home = p.select("a", targets).target
    p.select("b", targets)
    assert p.state()["active_sessions"] == 2
    time.sleep(0.08)
    p.select("", targets)
    assert p.state()["active_sessions"] == 0 and p.state()["sticky_sessions"] == 2
    assert p.select("a", targets).target is home
    assert p.state()["active_sessions"] == 1


def test_sticky_survives_adding_targets() -> None:
    targets = make_targets(2)
    p = policy("sticky_min_load", targets)
    homes = {f"s{i}": p.select(f"s{i}", targets).target for i in range(10)}
    grown = targets + make_targets(3)
    p.on_targets_changed(grown)
    assert all(p.select(k, grown).target is home for k, home in homes.items())


def test_sticky_moves_once_when_home_is_unroutable_and_sticks_to_new_home() -> None:
    targets = make_targets(3)
    p = policy("sticky_min_load", targets)
    old = p.select("s", targets).target
    without = [t for t in targets if t is not old]
    new = p.select("s", without).target
    assert new is not old
    assert p.select("s", targets).target is new  # the old home is back: no move back
    assert p.state()["session_moves"] == 1


def test_sticky_ended_sessions_stop_counting_for_placement() -> None:
    targets = make_targets(2)
    p = policy("sticky_min_load", targets)
    a = p.select("a", targets).target
    b = p.select("b", targets).target
    assert p.end_session("a") and not p.end_session("a")
    assert p.state()["active_sessions"] == 1 and p.state()["sticky_sessions"] == 1
    b.num_assigned = 0  # the tie-break would favour b: only the live count decides
    assert p.select("c", targets).target is a


def test_sticky_new_sessions_avoid_targets_whose_calls_are_in_flight() -> None:
    targets = make_targets(2)
    p = policy("sticky_min_load", targets)
    a = p.select("a", targets).target
    b = p.select("b", targets).target
    assert a is not b
    a.in_flight = 3  # same live sessions, but a's are generating
    assert p.select("c", targets).target is b


def _loaded_home(p, targets: list[Target], context_tokens: int):  # type: ignore[no-untyped-def]
    home = p.select("s", targets).target
    p.on_served("s", home, context_tokens)
    for t in targets:
        t.mean_call_s = 1.0
    return home


def test_sticky_moves_only_when_queueing_at_home_costs_more_than_reprefill() -> None:
    targets = make_targets(2, max_running=4)
    p = policy("sticky_min_load", targets, min_calls_between_moves=1,
               reprefill_s_per_1k_tokens=0.1)
    home = _loaded_home(p, targets, context_tokens=8000)  # re-prefill: 0.8 s
    home.in_flight = 6  # 3 calls ahead of this one wait: 0.75 s < 0.8 s
    choice = p.select("s", targets)
    assert choice.target is home and not choice.spilled
    home.in_flight = 8  # 5 wait: 1.25 s > 0.8 s
    choice = p.select("s", targets)
    assert choice.spilled and choice.target is not home
    assert p.home_of("s") is choice.target  # moved, not spilled for one call
    assert p.state()["load_moves"] == 1


def test_sticky_never_moves_below_the_running_cap_or_without_one() -> None:
    capped = make_targets(2, max_running=16)
    p = policy("sticky_min_load", capped, min_calls_between_moves=1)
    home = _loaded_home(p, capped, context_tokens=100)
    home.in_flight = 15  # a continuous-batching engine runs it at once
    assert p.select("s", capped).target is home
    unknown = make_targets(2)
    p = policy("sticky_min_load", unknown, min_calls_between_moves=1)
    home = _loaded_home(p, unknown, context_tokens=100)
    home.in_flight = 50
    assert p.select("s", unknown).target is home


def test_sticky_caps_how_often_a_session_moves() -> None:
    targets = make_targets(2, max_running=1)
    p = policy("sticky_min_load", targets, min_calls_between_moves=3,
               reprefill_s_per_1k_tokens=0.0)
    home = _loaded_home(p, targets, context_tokens=0)
    home.in_flight = 10
    homes = [p.select("s", targets).target for _ in range(2)]
    assert homes == [home, home]  # 3 calls at home before the first move
    moved = p.select("s", targets).target
    assert moved is not home
    moved.in_flight, home.in_flight = 10, 0
    assert [p.select("s", targets).target for _ in range(2)] == [moved, moved]
    assert p.select("s", targets).target is home
    assert p.state()["load_moves"] == 2


def test_manual_assigns_by_in_flight_then_sticks_without_a_load_bound() -> None:
    targets = make_targets(3)
    targets[0].in_flight, targets[1].in_flight, targets[2].in_flight = 3, 0, 2
    p = policy("manual", targets)
    assert p.select("s", targets).target is targets[1]
    targets[1].in_flight = 99
    assert p.select("s", targets).target is targets[1]
    assert p.select("s", [targets[0], targets[2]]).target is targets[2]


def test_sticky_draining_home_keeps_its_sessions() -> None:
    targets = make_targets(2)
    p = policy("sticky_min_load", targets)
    home = p.select("s", targets).target
    home.draining = True
    assert p.select("s", targets).target is home
    assert p.select("new", targets).target is not home


def test_consistent_hash_is_stable_and_spreads_keys() -> None:
    targets = make_targets(4)
    p = policy("consistent_hash", targets)
    first = {f"k{i}": p.select(f"k{i}", targets).target for i in range(2000)}
    assert all(p.select(k, targets).target is t for k, t in first.items())
    shares = Counter(id(t) for t in first.values())
    assert len(shares) == 4 and min(shares.values()) > 2000 / 4 * 0.6


def test_consistent_hash_skips_unroutable_and_moves_only_its_keys() -> None:
    targets = make_targets(4)
    p = policy("consistent_hash", targets)
    before = {f"k{i}": p.select(f"k{i}", targets).target for i in range(1000)}
    down = targets[2]
    alive = [t for t in targets if t is not down]
    after = {k: p.select(k, alive).target for k in before}
    for key, target in before.items():
        if target is down:
            assert after[key] is not down
        else:
            assert after[key] is target
    assert all(p.select(k, targets).target is t for k, t in before.items())  # back again


def test_min_load_picks_fewest_in_flight_and_rotates_ties() -> None:
    targets = make_targets(3)
    targets[0].in_flight, targets[1].in_flight, targets[2].in_flight = 2, 0, 1
    p = policy("min_load", targets)
    assert p.select("s", targets).target is targets[1]
    fresh = make_targets(3)
    picked = {id(p.select("s", fresh).target) for _ in range(3)}
    assert len(picked) == 3


def test_round_robin_cycles_over_targets() -> None:
    targets = make_targets(3)
    p = policy("round_robin", targets)
    picks = [p.select("same-session", targets).target for _ in range(6)]
    assert picks[:3] == picks[3:] and len({id(t) for t in picks}) == 3


def test_sticky_weighs_sessions_by_their_share_of_time_in_calls() -> None:
    targets = make_targets(2)
    p = policy("sticky_min_load", targets)
    busy = p.select("busy", targets).target
    idle = p.select("idle", targets).target
    for _ in range(2):
        time.sleep(0.03)  # "busy" spends its time in calls, "idle" between them
        p.on_served("busy", busy, 100)
        p.on_served("idle", idle, 100)
        p.select("busy", targets)
        time.sleep(0.03)
        p.select("idle", targets)
    busy.num_assigned = idle.num_assigned = 0
    assert p.select("new", targets).target is idle


def test_sticky_places_new_sessions_by_live_count_before_weight() -> None:
    """Fewer live sessions win over lighter ones: two sessions rarely in a call weigh less
    than one always in one, yet a new session goes to the single session's target. (Placed
    by weight first, the default's steady imbalance on bench/router.py's base trace was above
    perfect stickiness's, which places by count, in 4 of 4 paired runs.)"""
    targets = make_targets(2)
    p = policy("sticky_min_load", targets)
    busy_home = p.select("busy", targets).target
    light_home = next(t for t in targets if t is not busy_home)
    for key in ("light1", "light2"):
        assert p.select(key, [light_home]).target is light_home
    for _ in range(3):
        for key in ("light1", "light2"):
            p.on_served(key, light_home, 100)  # a light session's call ends at once
        time.sleep(0.03)
        p.on_served("busy", busy_home, 100)  # the busy one's call took the whole time
        for key in ("busy", "light1", "light2"):
            p.select(key, targets)
    busy_home.num_assigned = light_home.num_assigned = 0
    assert p.select("new", targets).target is busy_home
