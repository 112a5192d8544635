"""The router with several simulated engine processes: stickiness, dp ranks, spill, drain,
live policy switch."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services._proto.riptide.v1 import router_pb2
from services.testing.router_process import RouterProcess
from services.testing.sim_engine_process import SimEngineProcess, start_sim_engines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines() -> Iterator[list[SimEngineProcess]]:
    """Two single-rank engines and one with dp_size=2 and DP attention."""
    started = start_sim_engines(2, decode_s_per_token=0.001)
    try:
        started.append(SimEngineProcess(dp_size=2, decode_s_per_token=0.001))
        yield started
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture
def router(engines: list[SimEngineProcess]) -> Iterator[RouterProcess]:
    with RouterProcess(health_interval_s=0.2, health_timeout_s=0.5) as proc:
        assert [proc.register(e.url) for e in engines] == [[0], [0], [0, 1]]
        yield proc


def prompt(n: int = 300) -> list[int]:
    return [random.randrange(32000) for _ in range(n)]


def run_session(router: RouterProcess, key: str, turns: int) -> list[tuple[str, int, int]]:
    """(target, prompt tokens, cached tokens) per turn of one multi-turn session."""
    ids, seen = prompt(), []
    for _ in range(turns):
        reply = router.generate(key, ids, max_new_tokens=16)
        seen.append((f"{reply.engine_url}@{reply.dp_rank}", reply.prompt_tokens,
                     reply.cached_tokens))
        ids = ids + list(reply.output_ids) + prompt(20)
    return seen


def test_sessions_stick_and_later_turns_hit_the_prefix_cache(router: RouterProcess) -> None:
    with ThreadPoolExecutor(8) as pool:
        sessions = list(pool.map(lambda i: run_session(router, f"stick-{i}", 4), range(8)))
    for turns in sessions:
        assert len({target for target, _, _ in turns}) == 1
        for _, prompt_tokens, cached in turns[1:]:
            assert cached >= prompt_tokens - 20  # all but the new observation was cached
    used = {turns[0][0] for turns in sessions}
    assert len(used) == 4  # new sessions spread over all four targets
    state = router.state()
    assert state["policy"] == "sticky_min_load" and state["hit_rate"] > 0.6


def test_dp_ranks_are_targets_and_calls_carry_the_rank(
        router: RouterProcess, engines: list[SimEngineProcess]) -> None:
    dp_engine = engines[2]
    ranks = {t["dp_rank"] for t in router.targets() if t["engine_url"] == dp_engine.url}
    assert ranks == {0, 1}
    router.admin.post("/admin/drain", json={"url": engines[0].url}).raise_for_status()
    router.admin.post("/admin/drain", json={"url": engines[1].url}).raise_for_status()
    sessions = [run_session(router, f"dp-{i}", 3) for i in range(4)]
    for turns in sessions:
        assert turns[0][0].startswith(dp_engine.url)
        # The sim engine keeps one cache per rank: hits prove the rank was honoured.
        assert all(cached >= p - 20 for _, p, cached in turns[1:])
    assert {turns[0][0] for turns in sessions} == {f"{dp_engine.url}@0", f"{dp_engine.url}@1"}


def test_drained_target_keeps_its_sessions_and_takes_no_new_ones(
        router: RouterProcess, engines: list[SimEngineProcess]) -> None:
    first = run_session(router, "drain-old", 1)[0][0]
    url, rank = first.rsplit("@", 1)
    router.admin.post("/admin/drain", json={"url": url, "dp_rank": int(rank)}).raise_for_status()
    drained = next(t for t in router.targets() if t["id"] == first)
    assert drained["draining"] and drained["routable"]
    for i in range(6):
        assert run_session(router, f"drain-new-{i}", 1)[0][0] != first
    assert run_session(router, "drain-old", 1)[0][0] == first


def test_a_queued_session_moves_once_and_is_counted() -> None:
    """Engines that run one call at a time: a session's burst queues at home, so it moves."""
    small = start_sim_engines(2, max_running=1, decode_s_per_token=0.002)
    try:
        with RouterProcess(engine_urls=[e.url for e in small], min_calls_between_moves=4,
                           reprefill_s_per_1k_tokens=0.0) as router:
            ids = prompt()
            router.generate("hot", ids, max_new_tokens=50)  # learns the call time
            with ThreadPoolExecutor(8) as pool:
                replies = list(pool.map(
                    lambda _: router.generate("hot", ids, max_new_tokens=50), range(8)))
            assert len({r.engine_url for r in replies}) == 2
            moves = router.state()["load_moves"]
            assert 1 <= moves <= 2  # at most once per 4 calls of the session
            assert router.state()["spills"] == moves
            assert "riptide_router_spills_total" in router.admin.get("/metrics").text
    finally:
        for engine in small:
            engine.stop()


def test_end_session_frees_the_session_and_unknown_ones_say_so(router: RouterProcess) -> None:
    run_session(router, "ending", 1)
    live = router.state()["active_sessions"]
    assert router.end_session("ending") and not router.end_session("ending")
    assert router.state()["active_sessions"] == live - 1
    with pytest.raises(grpc.RpcError) as empty:
        router.end_session("")
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_policy_switches_live(router: RouterProcess) -> None:
    assert router.patch_config(policy="round_robin")["config"]["policy"] == "round_robin"
    targets = {t for t, _, _ in run_session(router, "rr", 8)}
    assert len(targets) == 4
    bad = router.admin.patch("/admin/config", json={"policy": "cache_aware"})
    assert bad.status_code == 400


def test_deregister_with_drain_moves_sessions_and_unknown_engines_fail_clearly(
        router: RouterProcess, engines: list[SimEngineProcess]) -> None:
    first = run_session(router, "leaving", 1)[0][0]
    url = first.rsplit("@", 1)[0]
    router.stub().DeregisterEngine(router_pb2.DeregisterEngineRequest(url=url, drain=True))
    assert all(t["engine_url"] != url for t in router.targets())
    assert not run_session(router, "leaving", 1)[0][0].startswith(url)
    with pytest.raises(grpc.RpcError) as missing:
        router.stub().DeregisterEngine(router_pb2.DeregisterEngineRequest(url=url))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as unreachable:
        router.register("http://127.0.0.1:9")
    assert unreachable.value.code() == grpc.StatusCode.UNAVAILABLE
