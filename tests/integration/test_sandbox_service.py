"""The sandbox service as a real `riptide serve sandbox` process, with local sandboxes.

The scripted model client (a test tool: `oracle` runs solve.sh as its only command, `noop`
does nothing) drives every bundled task through RunEpisode; then caps, cancellation, admin
state and cleanup after 32 concurrent episodes.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from services._proto.riptide.v1 import common_pb2, sandbox_pb2, sandbox_pb2_grpc
from services.common import process
from services.common.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
ADMIN = "admin-token-sandbox"
SCORED = common_pb2.VERDICT_STATUS_SCORED


def _start(tmp_path: Path, policy: str, trees: Path) -> dict[str, object]:
    grpc_port, admin_port = free_ports(2)
    config = tmp_path / f"{policy}.toml"
    config.write_text(
        f'[run]\nadmin_token = "{ADMIN}"\nlog_format = "text"\n'
        f'[sandbox]\ngrpc_port = {grpc_port}\nadmin_port = {admin_port}\n'
        f'tasks_dir = "{REPO / "tasks"}"\nmodel_client = "scripted"\n'
        f"max_concurrent_episodes = 32\nmax_concurrent_creates = 8\n"
        f'[sandbox.scripted]\npolicy = "{policy}"\n'
        f'[sandbox.provider]\ntype = "local"\nroot_dir = "{trees}"\n')
    proc = process.spawn([sys.executable, "-m", "services.cli", "serve", "sandbox",
                          "--config", str(config)], log_path=tmp_path / f"{policy}.log")
    return {"proc": proc, "grpc": f"127.0.0.1:{grpc_port}",
            "admin": f"http://127.0.0.1:{admin_port}", "log": tmp_path / f"{policy}.log"}


def _wait_ready(service: dict[str, object], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc = service["proc"]
        assert proc.poll() is None, Path(str(service["log"])).read_text()[-3000:]  # type: ignore[attr-defined]
        try:
            if httpx.get(f"{service['admin']}/readyz", timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("sandbox service not ready")


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, object]]]:
    tmp = tmp_path_factory.mktemp("sandbox-service")
    trees = Path(tempfile.mkdtemp(prefix="riptide-test-trees-"))
    trees.chmod(0o711)  # sandbox uids must reach their own trees below it
    started = {policy: _start(tmp, policy, trees) for policy in ("oracle", "noop")}
    for service in started.values():
        service["trees"] = trees
    try:
        for service in started.values():
            _wait_ready(service)
        yield started
    finally:
        for service in started.values():
            process.stop(service["proc"])  # type: ignore[arg-type]
        shutil.rmtree(trees, ignore_errors=True)


async def _episode(address: str, task_id: str, sample_id: str
                   ) -> tuple[list[sandbox_pb2.EpisodeProgress], common_pb2.Trajectory]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = sandbox_pb2_grpc.SandboxStub(channel)
        progress, trajectories = [], []
        async for event in stub.RunEpisode(sandbox_pb2.RunEpisodeRequest(
                task_id=task_id, sample_id=sample_id, group_id="g", sample_index=1)):
            if event.HasField("progress"):
                progress.append(event.progress)
            else:
                trajectories.append(event.trajectory)
    assert len(trajectories) == 1, "a stream ends with exactly one trajectory"
    return progress, trajectories[0]


def _tasks(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        return list(sandbox_pb2_grpc.SandboxStub(channel).ListTasks(
            sandbox_pb2.ListTasksRequest(), timeout=10).task_ids)


def _admin(service: dict[str, object], path: str) -> dict[str, object]:
    reply = httpx.get(f"{service['admin']}{path}", timeout=10,
                      headers={"Authorization": f"Bearer {ADMIN}"})
    reply.raise_for_status()
    return dict(reply.json())


@pytest.mark.slow
def test_oracle_scores_1_and_noop_scores_0_on_every_bundled_task(
        services: dict[str, dict[str, object]]) -> None:
    tasks = _tasks(str(services["oracle"]["grpc"]))
    assert len(tasks) >= 10

    async def run_all() -> dict[tuple[str, str], tuple[list, common_pb2.Trajectory]]:
        jobs = {(policy, task): _episode(str(services[policy]["grpc"]), task, f"{policy}-{task}")
                for policy in ("oracle", "noop") for task in tasks}
        results = await asyncio.gather(*jobs.values())
        return dict(zip(jobs, results, strict=True))

    results = asyncio.run(run_all())
    wrong = {key: (t.reward, t.status_message) for key, (_, t) in results.items()
             if t.status != SCORED or t.reward != (1.0 if key[0] == "oracle" else 0.0)}
    assert not wrong, f"(policy, task) -> (reward, message) that should not be: {wrong}"
    for (policy, task), (progress, trajectory) in results.items():
        kinds = [p.kind for p in progress]
        assert kinds[0] == "sandbox_ready" and kinds[-1] == "verifier" and "turn" in kinds
        assert trajectory.task_id == task and trajectory.sample_id == f"{policy}-{task}"
        assert trajectory.finish_reason == "complete"
        n = len(trajectory.response_ids)
        assert n == len(trajectory.loss_mask) == len(trajectory.rollout_logprobs) \
            == len(trajectory.weight_versions)
        assert trajectory.prompt_ids and sum(trajectory.loss_mask) > 0
        assert trajectory.timings.total_s >= trajectory.timings.verify_s > 0
    oracle_commands = [p for p in results[("oracle", tasks[0])][0] if p.kind == "command"]
    assert len(oracle_commands) == 1, "the oracle runs solve.sh as its only command"
    for service in services.values():
        assert _admin(service, "/admin/state")["details"]["sandboxes_alive"] == 0


def test_unknown_task_is_not_found(services: dict[str, dict[str, object]]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        asyncio.run(_episode(str(services["noop"]["grpc"]), "no-such-task", "s"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown task 'no-such-task'" in str(caught.value.details())
    assert "ListTasks" in str(caught.value.details())


def test_out_of_range_episode_requests_are_invalid_arguments(
        services: dict[str, dict[str, object]]) -> None:
    service = services["oracle"]
    task = _tasks(str(service["grpc"]))[0]
    sampling = common_pb2.SamplingParams
    bad = [sandbox_pb2.RunEpisodeRequest(task_id="", sample_id="s"),
           sandbox_pb2.RunEpisodeRequest(task_id=task, sample_id="s" * 100_000),
           sandbox_pb2.RunEpisodeRequest(task_id=task, sample_id="s", group_id="g\x00"),
           sandbox_pb2.RunEpisodeRequest(task_id=task, sample_id="s",
                                         sampling_params=sampling(temperature=-1)),
           sandbox_pb2.RunEpisodeRequest(task_id=task, sample_id="s",
                                         sampling_params=sampling(top_p=7)),
           # what an operator's probe found accepted: 2^32-1 new tokens (past the agent's
           # context cap) and an explicit 0 (read as unset before it was optional)
           sandbox_pb2.RunEpisodeRequest(task_id=task, sample_id="s",
                                         sampling_params=sampling(max_new_tokens=2**32 - 1)),
           sandbox_pb2.RunEpisodeRequest(task_id=task, sample_id="s",
                                         sampling_params=sampling(max_new_tokens=0))]
    with grpc.insecure_channel(str(service["grpc"])) as channel:
        stub = sandbox_pb2_grpc.SandboxStub(channel)
        for request in bad:
            with pytest.raises(grpc.RpcError) as rejected:
                list(stub.RunEpisode(request, timeout=10))
            assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
            assert len(rejected.value.details()) < 300, rejected.value.details()[:300]
    state = _admin(service, "/admin/state")["details"]
    assert state["sandboxes_alive"] == 0, "no sandbox was made for a bad request"
    _, trajectory = asyncio.run(_episode(str(service["grpc"]), task, "after-bad-input"))
    assert trajectory.status == SCORED and trajectory.reward == 1.0  # still serving


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


@pytest.mark.slow
def test_32_concurrent_episodes_leave_no_sandbox_or_process(
        services: dict[str, dict[str, object]]) -> None:
    service = services["oracle"]
    pid = service["proc"].pid  # type: ignore[attr-defined]
    tasks = _tasks(str(service["grpc"]))

    async def run_all() -> list[common_pb2.Trajectory]:
        jobs = [_episode(str(service["grpc"]), tasks[i % len(tasks)], f"c32-{i}")
                for i in range(32)]
        return [t for _, t in await asyncio.gather(*jobs)]

    trajectories = asyncio.run(run_all())
    assert all(t.status == SCORED and t.reward == 1.0 for t in trajectories)
    details = _admin(service, "/admin/state")["details"]
    assert details["sandboxes_alive"] == 0 and details["provider_stats"]["sandboxes_alive"] == 0
    assert details["episodes_running"] == 0 and details["delete_failures"] == 0
    assert _admin(service, "/admin/sandboxes")["sandboxes"] == []
    assert _descendants(pid) == [], "no process of any episode may outlive it"
    assert glob.glob(os.path.join(str(service["trees"]), f"{pid}-*", "skeleton")), \
        "the provider's directory is where the test looks"
    trees = glob.glob(os.path.join(str(service["trees"]), f"{pid}-*", "sbx-*"))
    assert trees == [], f"sandbox trees left behind: {trees}"


def test_a_cancelled_episode_still_deletes_its_sandbox(
        services: dict[str, dict[str, object]]) -> None:
    service = services["oracle"]

    async def cancel_after_ready() -> None:
        async with grpc.aio.insecure_channel(str(service["grpc"])) as channel:
            call = sandbox_pb2_grpc.SandboxStub(channel).RunEpisode(
                sandbox_pb2.RunEpisodeRequest(task_id=_tasks(str(service["grpc"]))[0],
                                              sample_id="cancelled"))
            async for event in call:
                if event.HasField("progress") and event.progress.kind == "sandbox_ready":
                    call.cancel()
                    break

    asyncio.run(cancel_after_ready())
    deadline = time.monotonic() + 20
    while _admin(service, "/admin/state")["details"]["sandboxes_alive"] and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert _admin(service, "/admin/state")["details"]["sandboxes_alive"] == 0


def test_caps_are_tunable_live_and_reported(services: dict[str, dict[str, object]]) -> None:
    service = services["noop"]
    headers = {"Authorization": f"Bearer {ADMIN}"}
    reply = httpx.patch(f"{service['admin']}/admin/config", headers=headers, timeout=10,
                        json={"max_concurrent_episodes": 5, "max_concurrent_creates": 2})
    assert reply.status_code == 200, reply.text
    details = _admin(service, "/admin/state")["details"]
    assert (details["max_concurrent_episodes"], details["max_concurrent_creates"]) == (5, 2)
    assert details["event_loop"] == "uvloop"  # the service's default
    bad = httpx.patch(f"{service['admin']}/admin/config", headers=headers, timeout=10,
                      json={"max_concurrent_creates": 0})
    assert bad.status_code == 400
    with grpc.insecure_channel(str(service["grpc"])) as channel:
        status = sandbox_pb2_grpc.SandboxStub(channel).GetStatus(common_pb2.StatusRequest(),
                                                                 timeout=10)
    assert status.service == "sandbox" and status.state == "ready"
    assert status.details["max_concurrent_creates"] == 2
    assert "acquire_ms_p50" in status.details


def test_a_sample_id_runs_once_at_a_time(services: dict[str, dict[str, object]]) -> None:
    service = services["oracle"]
    task = _tasks(str(service["grpc"]))[0]

    async def run() -> tuple[grpc.StatusCode, common_pb2.Trajectory]:
        async with grpc.aio.insecure_channel(str(service["grpc"])) as channel:
            stub = sandbox_pb2_grpc.SandboxStub(channel)
            first = stub.RunEpisode(sandbox_pb2.RunEpisodeRequest(task_id=task, sample_id="dup"))
            async for event in first:
                if event.HasField("progress") and event.progress.kind == "sandbox_ready":
                    break
            try:
                await _episode(str(service["grpc"]), task, "dup")
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            events = [event async for event in first]
        return code, events[-1].trajectory

    code, trajectory = asyncio.run(run())
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert trajectory.reward == 1.0, "the first episode is not disturbed"
