"""Health, circuit breaker and weight-version rules of a target."""

from __future__ import annotations

import time

from services.router.registry import max_input_tokens
from services.router.targets import Engine, Target


def test_ejected_after_consecutive_failures_and_readmitted_after_successes() -> None:
    engine = Engine(url="http://e:1")
    assert engine.record_health(False, 3, 2) is None
    assert engine.record_health(True, 3, 2) is None  # a success resets the failure count
    assert [engine.record_health(False, 3, 2) for _ in range(3)] == [None, None, "ejected"]
    assert not engine.healthy and engine.num_ejections == 1
    assert engine.record_health(True, 3, 2) is None
    assert engine.record_health(True, 3, 2) == "admitted"
    assert engine.healthy


def test_weight_version_gates_routability() -> None:
    target = Target(Engine(url="http://e:1", weight_version="3"), 0)
    assert target.routable(None, 5)  # no version set yet: any
    assert target.routable(3, 5)
    assert not target.routable(4, 5)
    target.engine.weight_version = "4"
    assert target.routable(4, 5)


def test_circuit_opens_after_failed_calls_then_half_opens_for_one_trial() -> None:
    target = Target(Engine(url="http://e:1"), 0)
    opened = [target.record_call(False, 3, 0.05) for _ in range(3)]
    assert opened == [False, False, True]
    assert not target.routable(None, 3)
    time.sleep(0.06)
    assert target.routable(None, 3)  # half-open: one trial call
    target.in_flight = 1
    assert not target.routable(None, 3)  # ...and only one
    target.in_flight = 0
    target.record_call(True, 3, 0.05)
    assert target.routable(None, 3) and target.call_failures == 0


def test_readmission_closes_the_circuit_its_outage_opened() -> None:
    engine = Engine(url="http://e:1")
    target = Target(engine, 0)
    engine.targets.append(target)
    for _ in range(3):
        engine.record_health(False, 3, 2)
        target.record_call(False, 3, 60.0)  # calls to it failed while it was down
    assert not target.routable(None, 3)
    engine.record_health(True, 3, 2)
    assert not target.routable(None, 3)  # one success does not re-admit it
    assert engine.record_health(True, 3, 2) == "admitted"
    assert target.routable(None, 3)  # not another 60 s of a closed door after it is back


def test_unhealthy_or_leaving_engine_is_not_routable() -> None:
    target = Target(Engine(url="http://e:1"), 0)
    target.engine.healthy = False
    assert not target.routable(None, 5)
    target.engine.healthy, target.engine.leaving = True, True
    assert not target.routable(None, 5)


def test_dp_ranks_become_targets_only_with_dp_attention() -> None:
    from services.router.registry import EngineRegistry

    dp = EngineRegistry._engine_from_info("http://e:1", {"dp_size": 4,
                                                          "enable_dp_attention": True})
    assert dp.dp_aware and [t.dp_rank for t in dp.targets] == [0, 1, 2, 3]
    plain = EngineRegistry._engine_from_info("http://e:1", {"dp_size": 4})
    assert not plain.dp_aware and [t.dp_rank for t in plain.targets] == [0]
    assert len(EngineRegistry._engine_from_info("http://e:1", {}).targets) == 1


def test_a_load_signal_that_never_arrives_or_stops_is_missing_and_can_come_back() -> None:
    engine = Engine(url="http://e:1")
    target = Target(engine, 0)
    assert engine.load_signal(3) == "pending"  # not read yet
    assert [engine.record_load(False, 3) for _ in range(3)] == [None, None, "lost"]
    assert engine.load_signal(3) == "missing"
    assert target.view(None, 5, 3)["load_signal"] == "missing"
    assert engine.record_load(True, 3) == "back" and engine.load_signal(3) == "ok"
    assert engine.record_load(False, 3) is None and engine.load_signal(3) == "ok"  # one miss
    assert [engine.record_load(False, 3) for _ in range(2)] == [None, "lost"]  # stopped


def test_the_longest_prompt_comes_from_server_info() -> None:
    assert max_input_tokens({"max_req_input_len": 40959, "context_length": 40960}) == 40959
    assert max_input_tokens({"context_length": 4096}) == 4095
    assert max_input_tokens({"context_length": None}) is None
    assert max_input_tokens({"max_req_input_len": True}) is None
