"""The router's health handling with real engine processes: ejection and re-admission,
weight-version gating, retries only before generation, and an engine dying mid-run."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services._proto.riptide.v1 import common_pb2, router_pb2
from services.common.ports import free_port
from services.testing.router_process import RouterProcess
from services.testing.sim_engine_process import SimEngineProcess, start_sim_engines

pytestmark = pytest.mark.slow
FAST_HEALTH = {"health_interval_s": 0.2, "health_timeout_s": 0.5, "unhealthy_after_failures": 2,
               "healthy_after_successes": 2}


@pytest.fixture
def engines() -> Iterator[list[SimEngineProcess]]:
    started = start_sim_engines(3, decode_s_per_token=0.002)
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


def ids(n: int = 200) -> list[int]:
    return [random.randrange(32000) for _ in range(n)]


def wait_for(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def target_of(router: RouterProcess, url: str) -> dict:  # type: ignore[type-arg]
    return next(t for t in router.targets() if t["engine_url"] == url)


def test_ejection_and_readmission(engines: list[SimEngineProcess]) -> None:
    with RouterProcess(engine_urls=[e.url for e in engines], **FAST_HEALTH) as router:
        sick = engines[0]
        sick.control(fail_health=True)
        wait_for(lambda: not target_of(router, sick.url)["healthy"])
        assert target_of(router, sick.url)["ejections"] == 1
        for i in range(12):
            assert router.generate(f"eject-{i}", ids()).engine_url != sick.url
        sick.control(fail_health=False)
        wait_for(lambda: target_of(router, sick.url)["routable"])
        served = {router.generate(f"back-{i}", ids()).engine_url for i in range(12)}
        assert sick.url in served
        ejections = f'riptide_router_ejections_total{{engine="{sick.url}"}} 1.0'
        assert ejections in router.admin.get("/metrics").text
        assert f"engine ejected url={sick.url}" in router.log_tail()


def test_weight_version_gates_engines(engines: list[SimEngineProcess]) -> None:
    with RouterProcess(wait_for_target_s=0.5, **FAST_HEALTH) as router:
        for engine in engines:
            router.register(engine.url)
        router.stub().SetWeightVersion(router_pb2.SetWeightVersionRequest(weight_version=1))
        with pytest.raises(grpc.RpcError) as stale:
            router.generate("v", ids())
        assert stale.value.code() == grpc.StatusCode.UNAVAILABLE
        engines[1].set_weight_version(1)
        wait_for(lambda: target_of(router, engines[1].url)["routable"])
        for i in range(6):
            reply = router.generate(f"v-{i}", ids())
            assert reply.engine_url == engines[1].url and reply.weight_version == 1
        # A (re)joining engine still on old weights is registered but never served.
        with SimEngineProcess(weight_version="0") as late:
            router.register(late.url)
            assert not target_of(router, late.url)["routable"]
            for i in range(6):
                assert router.generate(f"late-{i}", ids()).engine_url == engines[1].url
            late.set_weight_version(1)
            wait_for(lambda: target_of(router, late.url)["routable"])


def test_503_is_retried_elsewhere_but_500_is_not(engines: list[SimEngineProcess]) -> None:
    with RouterProcess(engine_urls=[e.url for e in engines], policy="round_robin",
                       **FAST_HEALTH) as router:
        engines[0].control(fail_generate_status=503)
        for i in range(6):
            assert router.generate(f"r-{i}", ids()).engine_url != engines[0].url
        retries = router.state()["retries"]
        assert retries >= 1
        engines[0].control(fail_generate_status=500)
        failures = 0
        for i in range(6):
            try:
                router.generate(f"f-{i}", ids())
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                assert "not retried" in (exc.details() or "")
                failures += 1
        assert failures >= 1 and router.state()["retries"] == retries
        log = router.log_tail()  # text logs keep the structured fields
        assert "generate failed" in log and f"engine={engines[0].url}" in log
        assert "outcome=failed" in log and "answered 500" in log


def test_dead_engine_loses_no_session_that_had_not_started_generating(
        engines: list[SimEngineProcess]) -> None:
    with RouterProcess(engine_urls=[e.url for e in engines], **FAST_HEALTH) as router:
        victim = engines[0]
        killed_at: list[float] = []
        failed_calls: list[float] = []
        lock = threading.Lock()

        def session(key: str) -> int:
            prompt, turns = ids(), 0
            while turns < 6:
                started = time.monotonic()
                try:
                    reply = router.generate(key, prompt, max_new_tokens=40)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    with lock:
                        failed_calls.append(started)
                    continue  # the agent retries its turn
                prompt = prompt + list(reply.output_ids) + ids(10)
                turns += 1
                if key == "s-0" and turns == 2 and not killed_at:
                    victim.kill()
                    killed_at.append(time.monotonic())
            return turns

        with ThreadPoolExecutor(12) as pool:
            finished = list(pool.map(session, [f"s-{i}" for i in range(12)]))
        assert finished == [6] * 12
        assert killed_at
        # Only calls already running on the victim when it died may fail.
        assert all(started < killed_at[0] for started in failed_calls), failed_calls
        assert len(failed_calls) <= 12
        dead = target_of(router, victim.url)
        assert not dead["routable"]
        assert router.state()["session_moves"] >= 1  # the victim's sessions found new homes


def test_configured_engine_that_starts_late_is_registered() -> None:
    port = free_port()
    with RouterProcess(engine_urls=[f"http://127.0.0.1:{port}"], **FAST_HEALTH) as router:
        assert router.targets() == []
        with SimEngineProcess(port=port) as late:
            wait_for(lambda: bool(router.targets()))
            assert router.generate("late", ids()).engine_url == late.url


def test_an_ejected_engine_that_is_back_is_readmitted_between_health_rounds(
        engines: list[SimEngineProcess]) -> None:
    # Full rounds every 3 s would need two of them (3-6 s) to re-admit it.
    with RouterProcess(engine_urls=[e.url for e in engines], health_interval_s=3.0,
                       health_timeout_s=0.5, unhealthy_after_failures=1,
                       healthy_after_successes=2, readmit_probe_interval_s=0.1) as router:
        sick = engines[0]
        sick.control(fail_health=True)
        wait_for(lambda: not target_of(router, sick.url)["healthy"], timeout_s=10)
        sick.control(fail_health=False)
        back = time.monotonic()
        wait_for(lambda: target_of(router, sick.url)["routable"], timeout_s=10)
        assert time.monotonic() - back < 2.0


def test_load_falls_back_per_route_and_a_missing_load_signal_is_reported() -> None:
    """Both engines speak the current info routes (/model_info, /server_info); one serves its
    load only on /get_load, the other on no route at all. The first is polled on /get_load
    (its queued tokens reach the router while a call runs); the second shows up as "no load
    signal" in the admin state, GetStatus and the metrics, and still takes calls."""
    with SimEngineProcess(contract="current", load_routes="/get_load",
                          decode_s_per_token=0.05) as polled, \
            SimEngineProcess(contract="current", load_routes="") as silent, \
            RouterProcess(engine_urls=[polled.url, silent.url], policy="manual",
                          **FAST_HEALTH) as router:
        wait_for(lambda: target_of(router, silent.url)["load_signal"] == "missing")
        assert target_of(router, polled.url)["load_signal"] == "ok"
        assert router.state()["no_load_signal"] == [silent.url]
        status = router.stub().GetStatus(common_pb2.StatusRequest(), timeout=10)
        assert list(status.details["no_load_signal"]) == [silent.url]
        metrics = router.admin.get("/metrics").text
        assert f'riptide_router_load_signal{{engine="{silent.url}"}} 0.0' in metrics
        assert f'riptide_router_load_signal{{engine="{polled.url}"}} 1.0' in metrics
        assert f'riptide_router_load_read_failures_total{{engine="{silent.url}"}}' in metrics
        assert "engine sends no load signal" in router.log_tail()
        # the silent engine still serves; the polled one's load is read while a call runs there
        served = {router.generate(f"both-{i}", ids(20), max_new_tokens=2).engine_url
                  for i in range(8)}
        assert served == {polled.url, silent.url}
        # the manual policy keeps a key where its first call went: find one on `polled`
        key = next(f"slow-{i}" for i in range(64)
                   if router.generate(f"slow-{i}", ids(5), max_new_tokens=1).engine_url
                   == polled.url)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(router.generate, key, ids(300), 60)
            wait_for(lambda: target_of(router, polled.url)["reported_tokens"] == 300)
            assert running.result().engine_url == polled.url
