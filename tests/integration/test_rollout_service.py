"""The rollout service with real processes: Redis, the router, two built-in engines launched by
the rollout service's fleet, and the sandbox service (local sandboxes, bundled tasks, the
model through the router); with RIPTIDE_ITEST_EPISODE_SERVER=1 the model-only test episode
server (services/testing/episode_server.py) stands in for the sandbox service. The test plays
the trainer's end of UpdateWeights (services/testing/weight_push.py)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services._proto.riptide.v1 import common_pb2
from services.common import process
from services.common.config import RedisConfig, dump_config
from services.common.ports import free_ports
from services.common.redis_connect import connect
from services.deployment import validate_config
from services.testing.engine_process import tiny_model_path
from services.testing.redis_server import RedisServer
from services.testing.weight_push import WeightPusher

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TOKEN = "rollout-itest-admin"
IN_FLIGHT = 4
TASKS = ["bash-greet-script", "json-group-by", "config-edit"]
REAL_SANDBOX = os.environ.get("RIPTIDE_ITEST_EPISODE_SERVER") != "1"


class Stack:
    def __init__(self, tmp: Path, redis_config: RedisConfig) -> None:
        ports = iter(free_ports(6))
        sections: dict[str, dict[str, Any]] = {
            name: {"grpc_port": next(ports), "admin_port": next(ports)}
            for name in ("router", "sandbox", "rollout")}
        sections["router"].update(health_interval_s=0.5, wait_for_target_s=60.0)
        sections["sandbox"].update(
            tasks_dir=str(REPO / "tasks"), max_concurrent_episodes=16,
            agent={"max_turns": 2, "max_new_tokens": 8, "max_context_tokens": 4096})
        sections["rollout"].update(
            task_ids=TASKS,
            scheduler={"max_concurrent_samples": IN_FLIGHT, "n_samples_per_prompt": 2,
                       "num_groups_per_batch": 2, "max_new_tokens": 8, "max_staleness": 100,
                       "drop_zero_variance_groups": False},
            fleet={"kind": "builtin", "num_engines": 2, "model_path": str(tiny_model_path()),
                   "health_interval_s": 0.5, "start_timeout_s": 180.0,
                   "log_dir": str(tmp / "engines")})
        self.config = validate_config({
            "run": {"name": "itest", "admin_token": TOKEN, "log_format": "text"},
            "redis": redis_config.model_dump(exclude_none=True), **sections})
        path = tmp / "deploy.toml"
        path.write_text(dump_config(self.config))
        self.tmp = tmp
        self.procs: dict[str, Any] = {}
        if not REAL_SANDBOX:
            self.procs["sandbox"] = process.spawn(
                [sys.executable, "-m", "services.testing.episode_server",
                 "--port", str(self.config.sandbox.grpc_port),
                 "--router", self.config.router.grpc_address, "--tasks", ",".join(TASKS),
                 "--turns", "3"], log_path=tmp / "sandbox.log", cwd=REPO)
        for name in ("router", "sandbox", "rollout") if REAL_SANDBOX else ("router", "rollout"):
            self.procs[name] = process.spawn(
                [sys.executable, "-m", "services.cli", "serve", name, "--config", str(path)],
                log_path=tmp / f"{name}.log", cwd=REPO)
            self._wait_ready(name)
        self.redis = connect(redis_config)

    def _wait_ready(self, name: str, timeout_s: float = 240.0) -> None:
        url = f"{getattr(self.config, name).admin_url}/readyz"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.procs[name].poll() is None, f"{name} died:\n{self.log(name)}"
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"{name} not ready:\n{self.log(name)}")

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def state(self) -> dict[str, Any]:
        reply = httpx.get(f"{self.config.rollout.admin_url}/admin/state", timeout=10,
                          headers={"authorization": f"Bearer {TOKEN}"})
        reply.raise_for_status()
        return dict(reply.json()["details"])

    def groups(self) -> list[common_pb2.Group]:
        entries: Any = self.redis.xrange("riptide:itest:samples")
        return [common_pb2.Group.FromString(fields[b"group"]) for _, fields in entries]

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            process.stop(self.procs[name])


def wait_for(probe: Callable[[], Any], what: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with RedisServer() as server:
        stack = Stack(tmp_path_factory.mktemp("rollout"), server.config)
        try:
            yield stack
            engine_pids = [e["pid"] for e in stack.state()["engines"]]
        finally:
            stack.stop()
        # SIGTERM to the rollout service stops the engines it launched: no orphans
        assert not [pid for pid in engine_pids if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def pusher(stack: Stack) -> Iterator[WeightPusher]:
    pusher = WeightPusher(stack.config.rollout.grpc_address)
    yield pusher
    pusher.close()


def perturbed_weights(scale: float) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()))
    return {name: (p.detach() * scale).contiguous() for name, p in model.named_parameters()}


def test_in_flight_holds_at_target_while_groups_flow(stack: Stack) -> None:
    wait_for(lambda: len(stack.groups()) >= 2, "the first groups in the stream", 240)
    seen, written = [], []
    for _ in range(12):
        state = stack.state()["scheduler"]
        seen.append(state["in_flight_samples"])
        written.append(state["written_groups"])
        time.sleep(0.5)
    assert max(seen) <= IN_FLIGHT and seen.count(IN_FLIGHT) >= 9, seen
    assert stack.state()["scheduler"]["mean_in_flight"] >= IN_FLIGHT - 0.3
    wait_for(lambda: len(stack.groups()) > written[0] + 1, "more groups")
    for group in stack.groups():
        assert len(group.samples) == 2 and group.task_id in TASKS
        assert all(s.status == common_pb2.VERDICT_STATUS_SCORED for s in group.samples)
        assert all(v in (-1, 0) for s in group.samples for v in s.weight_versions)


def test_admin_pause_resume_live_tuning_and_metrics(stack: Stack) -> None:
    admin = httpx.Client(base_url=stack.config.rollout.admin_url, timeout=10,
                         headers={"authorization": f"Bearer {TOKEN}"})
    reply = admin.patch("/admin/config", json={"max_concurrent_samples": 2})
    assert reply.status_code == 200 and reply.json()["config"]["max_concurrent_samples"] == 2
    wait_for(lambda: stack.state()["scheduler"]["in_flight_samples"] == 2, "in flight 2", 60)
    assert admin.patch("/admin/config", json={"n_samples_per_prompt": 3}).status_code == 400
    assert admin.post("/admin/pause").status_code == 200
    wait_for(lambda: stack.state()["scheduler"]["in_flight_samples"] == 0, "drained", 60)
    submitted = stack.state()["scheduler"]["submitted_samples"]
    time.sleep(1.0)
    assert stack.state()["scheduler"]["submitted_samples"] == submitted
    assert admin.patch("/admin/config", json={"max_concurrent_samples": IN_FLIGHT}).status_code \
        == 200
    assert admin.post("/admin/resume").status_code == 200
    wait_for(lambda: stack.state()["scheduler"]["in_flight_samples"] == IN_FLIGHT, "refilled")
    metrics = httpx.get(f"{stack.config.rollout.admin_url}/metrics", timeout=10).text
    assert "riptide_rollout_in_flight_samples " in metrics
    assert "riptide_rollout_submitted_samples_total" in metrics
    assert "riptide_rollout_engine_running_requests" in metrics
    assert "riptide_rollout_group_latency_seconds_count" in metrics


def test_weight_update_mid_run_pauses_syncs_and_resumes_losing_nothing(
        stack: Stack, pusher: WeightPusher) -> None:
    before = stack.state()["scheduler"]
    assert before["in_flight_samples"] > 0
    paused_during: list[bool] = []
    answered = pusher.push(perturbed_weights(1.5), version=1, between_buckets=lambda: (
        paused_during.append(stack.state()["weight_updates"]["engines_paused"])))
    assert answered == {"world_size": 3, "must_join": True, "buckets": [0, 1], "committed": 1}
    assert paused_during == [True, True]
    state = stack.state()
    assert not state["weight_updates"]["engines_paused"]
    assert state["scheduler"]["weight_version"] == 1
    for engine in state["engines"]:
        assert engine["weight_version"] == 1 and engine["in_weight_group"]
        assert httpx.get(f"{engine['url']}/model_info").json()["weight_version"] == "1"
    # episodes in flight across the update finish and are scored: none is lost
    wait_for(lambda: any(v == 1 for g in stack.groups() for s in g.samples
                         for v in s.weight_versions), "tokens of weight version 1")
    after = stack.state()["scheduler"]
    assert after["runner_errors"] == before["runner_errors"]
    assert after["no_verdict_samples"] == before["no_verdict_samples"]
    assert after["submitted_samples"] == after["finished_samples"] + after["in_flight_samples"]
    # a second update reuses the group
    answered = pusher.push(perturbed_weights(1.25), version=2)
    assert answered["must_join"] is False and answered["committed"] == 2
    metrics = httpx.get(f"{stack.config.rollout.admin_url}/metrics", timeout=10).text
    assert "riptide_rollout_weight_update_seconds_count 2.0" in metrics


def test_killed_engine_is_restarted_resynced_and_reregistered(
        stack: Stack, pusher: WeightPusher) -> None:
    victim = stack.state()["engines"][0]
    os.killpg(victim["pid"], signal.SIGKILL)
    restarted = wait_for(lambda: next(
        (e for e in stack.state()["engines"] if e["url"] == victim["url"]
         and e["restarts"] == 1 and e["state"] == "awaiting_weights"), None),
        "the engine to come back and wait for weights", 180)
    assert not restarted["registered"] and restarted["pid"] != victim["pid"]
    written = stack.state()["scheduler"]["written_groups"]
    answered = pusher.push(perturbed_weights(1.1), version=3)
    assert answered["must_join"] is True and answered["world_size"] == 3
    engine = next(e for e in stack.state()["engines"] if e["url"] == victim["url"])
    assert engine["state"] == "ready" and engine["registered"] and engine["weight_version"] == 3
    assert httpx.get(f"{victim['url']}/model_info").json()["weight_version"] == "3"
    wait_for(lambda: stack.state()["scheduler"]["written_groups"] >= written + 2,
             "groups after the restart")


def test_out_of_range_weight_updates_are_invalid_arguments_and_lose_nothing(
        stack: Stack, pusher: WeightPusher) -> None:
    import grpc

    from services._proto.riptide.v1 import rollout_pb2 as pb
    from services._proto.riptide.v1 import rollout_pb2_grpc

    weights = perturbed_weights(1.0)
    wait_for(lambda: stack.state()["weight_updates"]["in_progress"] is False, "no update")
    version = stack.state()["weight_version"] + 1
    pusher.push(weights, version=version, num_buckets=1)  # the group is formed and kept
    stub = rollout_pb2_grpc.RolloutStub(pusher.channel)

    def begin(**fields: Any) -> pb.WeightUpdateRequest:
        good = {"weight_version": version + 1, "master_address": "127.0.0.1",
                "master_port": pusher.port, "group_name": pusher.group_name,
                "backend": "gloo"}
        return pb.WeightUpdateRequest(begin=pb.WeightUpdateBegin(**{**good, **fields}))

    bad_bucket = pb.WeightUpdateRequest(bucket=pb.WeightBucket(bucket_index=0, tensors=[
        pb.TensorSpec(name="model.norm.weight", dtype="complex128", shape=[64])]))
    for stream in ([begin(weight_version=-1)], [begin(master_port=0)],
                   [begin(backend="mpi")], [begin(), bad_bucket]):
        with pytest.raises(grpc.RpcError) as rejected:
            list(stub.UpdateWeights(iter(stream), timeout=60))
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT, stream
        assert len(rejected.value.details()) < 300, rejected.value.details()[:300]
    state = stack.state()
    assert state["weight_version"] == version and not state["needs_weights"]
    assert not state["weight_updates"]["in_progress"]
    assert not state["weight_updates"]["engines_paused"]
    assert all(e["state"] == "ready" for e in state["engines"]), state["engines"]
    # nothing wedged: the next real update goes through and episodes keep flowing
    finished = state["scheduler"]["finished_samples"]
    assert pusher.push(weights, version=version + 1, num_buckets=1)["committed"] == version + 1
    wait_for(lambda: stack.state()["scheduler"]["finished_samples"] > finished, "episodes")
