"""Decisions of each routing policy, on hand-made targets."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from services.common.errors import ConfigError
from services.router.config import RouterConfig
from services.router.policies import make_policy
from services.router.targets import Engine, Target

POLICIES = ("sticky_min_load", "consistent_hash", "min_load", "round_robin")


def make_targets(n: int) -> list[Target]:
    return [Target(Engine(url=f"http://e{i}:1"), 0) for i in range(n)]


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


def test_sticky_spills_when_home_exceeds_skew_and_keeps_home() -> None:
    targets = make_targets(4)
    p = policy("sticky_min_load", targets, max_load_skew=1.5, spill_min_in_flight=2)
    home = p.select("s", targets).target
    home.in_flight = 8
    for t in targets:
        if t is not home:
            t.in_flight = 2
    choice = p.select("s", targets)
    assert choice.spilled and choice.target is not home
    home.in_flight = 2  # back under 1.5 x mean
    assert p.select("s", targets).target is home


def test_sticky_does_not_spill_below_min_in_flight() -> None:
    targets = make_targets(4)
    p = policy("sticky_min_load", targets, max_load_skew=1.0, spill_min_in_flight=5)
    home = p.select("s", targets).target
    home.in_flight = 3
    choice = p.select("s", targets)
    assert choice.target is home and not choice.spilled


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
