"""An episode whose turns come from a real model: built-in engine (tiny model) behind the real
router, called by the sandbox service's agent through Router.Generate, token-in token-out."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from services._proto.riptide.v1 import common_pb2, sandbox_pb2, sandbox_pb2_grpc
from services.common import process
from services.common.ports import free_ports
from services.common.tiny_model import create_tiny_model

REPO = Path(__file__).resolve().parents[2]
ADMIN = "admin-token-router-test"


def _wait(url: str, proc: object, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]  # type: ignore[attr-defined]
        try:
            if httpx.get(url, timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("sandbox-router")
    model = create_tiny_model(tmp / "model")
    engine_port, router_grpc, router_admin, sandbox_grpc, sandbox_admin = free_ports(5)
    config = tmp / "stack.toml"
    config.write_text(
        f'[run]\nadmin_token = "{ADMIN}"\nlog_format = "text"\nname = "routed"\n'
        f'[engine]\nport = {engine_port}\nmodel_path = "{model}"\nweight_version = "3"\n'
        f'[router]\ngrpc_port = {router_grpc}\nadmin_port = {router_admin}\n'
        f'engine_urls = ["http://127.0.0.1:{engine_port}"]\n'
        f'[sandbox]\ngrpc_port = {sandbox_grpc}\nadmin_port = {sandbox_admin}\n'
        f'tasks_dir = "{REPO / "tasks"}"\ntokenizer_path = "{model}"\n'
        f"[sandbox.agent]\nmax_turns = 2\n")
    procs = []
    try:
        for name, ready in (("engine", f"http://127.0.0.1:{engine_port}/health"),
                            ("router", f"http://127.0.0.1:{router_admin}/readyz"),
                            ("sandbox", f"http://127.0.0.1:{sandbox_admin}/readyz")):
            log = tmp / f"{name}.log"
            command = (["-m", "services.engine"] if name == "engine"
                       else ["-m", "services.cli", "serve", name])
            proc = process.spawn([sys.executable, *command, "--config", str(config)],
                                 log_path=log)
            procs.append(proc)
            _wait(ready, proc, log)
        yield {"sandbox": f"127.0.0.1:{sandbox_grpc}",
               "admin": f"http://127.0.0.1:{sandbox_admin}",
               "router_admin": f"http://127.0.0.1:{router_admin}"}
    finally:
        for proc in reversed(procs):
            process.stop(proc)


@pytest.mark.slow
def test_a_model_episode_keeps_tokens_exactly(stack: dict[str, str]) -> None:
    async def run() -> common_pb2.Trajectory:
        async with grpc.aio.insecure_channel(stack["sandbox"]) as channel:
            stub = sandbox_pb2_grpc.SandboxStub(channel)
            events = [e async for e in stub.RunEpisode(sandbox_pb2.RunEpisodeRequest(
                task_id="csv-revenue", sample_id="routed-1",
                sampling_params=common_pb2.SamplingParams(max_new_tokens=24, temperature=1.0,
                                                          sampling_seed=7)))]
        return events[-1].trajectory

    trajectory = asyncio.run(run())
    assert trajectory.status == common_pb2.VERDICT_STATUS_SCORED, trajectory.status_message
    assert trajectory.reward == 0.0  # a random tiny model does not solve the task
    assert trajectory.finish_reason in ("max_turns", "complete") and trajectory.num_turns >= 1
    mask = list(trajectory.loss_mask)
    generated = [i for i, m in enumerate(mask) if m == 1]
    assert 0 < len(generated) <= 2 * 24
    assert all(trajectory.rollout_logprobs[i] < 0 for i in generated), "engine log-probs kept"
    assert all(trajectory.rollout_logprobs[i] == 0 for i, m in enumerate(mask) if m == 0)
    assert all(trajectory.weight_versions[i] == 3 for i in generated), "engine's weight version"
    assert all(trajectory.weight_versions[i] == -1 for i, m in enumerate(mask) if m == 0)
    assert mask[0] == 1, "the response starts with the model's first turn"
    # The episode's end reached the router (EndSession): it no longer counts the session.
    deadline = time.monotonic() + 10
    while True:
        state = httpx.get(f"{stack['router_admin']}/admin/state", timeout=5,
                          headers={"authorization": f"Bearer {ADMIN}"}).json()["details"]
        if state["sticky_sessions"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert state["sticky_sessions"] == 0 and state["active_sessions"] == 0
