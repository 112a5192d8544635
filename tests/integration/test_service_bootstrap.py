"""The shared bootstrap in a real process: gRPC health, errors, token, admin REST, SIGTERM."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services._proto.riptide.v1 import common_pb2, sandbox_pb2, sandbox_pb2_grpc, trainer_pb2_grpc
from services.common.grpc_server import call_metadata
from services.testing.probe_service import probe_process

ADMIN = "admin-token-123"
GRPC_TOKEN = "grpc-token-456"


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[dict[str, object]]:
    with probe_process(tmp_path, ADMIN, GRPC_TOKEN) as running:
        yield {"proc": running.proc, "grpc": running.grpc, "admin": running.admin,
               "log": running.log}


def test_grpc_health_reports_serving(probe: dict[str, object]) -> None:
    with grpc.insecure_channel(str(probe["grpc"])) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_token_is_required(probe: dict[str, object]) -> None:
    with grpc.insecure_channel(str(probe["grpc"])) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            stub.GetStatus(common_pb2.StatusRequest(), timeout=5)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.GetStatus(common_pb2.StatusRequest(), timeout=5,
                               metadata=call_metadata(GRPC_TOKEN))
    assert reply.service == "probe" and reply.state == "ready"
    assert reply.details["max_widgets"] == 4


def test_errors_map_to_status_codes_with_their_message(probe: dict[str, object]) -> None:
    meta = call_metadata(GRPC_TOKEN)
    with grpc.insecure_channel(str(probe["grpc"])) as channel:
        stub = sandbox_pb2_grpc.SandboxStub(channel)
        with pytest.raises(grpc.RpcError) as rejected:
            stub.ListTasks(sandbox_pb2.ListTasksRequest(), timeout=5, metadata=meta)
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "always rejects" in rejected.value.details()
        events = stub.RunEpisode(sandbox_pb2.RunEpisodeRequest(task_id="t"), timeout=5,
                                 metadata=meta)
        first = next(events)
        assert first.progress.kind == "turn"
        with pytest.raises(grpc.RpcError) as crashed:
            next(events)
    assert crashed.value.code() == grpc.StatusCode.INTERNAL
    assert "ValueError: probe: crashed after one event" in crashed.value.details()


def test_admin_routes_need_the_bearer_token(probe: dict[str, object]) -> None:
    admin = str(probe["admin"])
    assert httpx.get(f"{admin}/healthz").status_code == 200
    assert httpx.get(f"{admin}/admin/state").status_code == 401
    wrong = httpx.get(f"{admin}/admin/state", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    ok = httpx.get(f"{admin}/admin/state", headers={"Authorization": f"Bearer {ADMIN}"})
    assert ok.status_code == 200 and ok.json()["service"] == "probe"
    assert httpx.post(f"{admin}/admin/pause").status_code == 401
    metrics = httpx.get(f"{admin}/metrics")
    assert metrics.status_code == 200 and b"process_cpu_seconds_total" in metrics.content


def test_pause_resume_and_live_config(probe: dict[str, object]) -> None:
    admin = str(probe["admin"])
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.post(f"{admin}/admin/pause", headers=auth).json()["state"] == "paused"
    assert httpx.post(f"{admin}/admin/pause", headers=auth).status_code == 409
    assert httpx.post(f"{admin}/admin/resume", headers=auth).json()["state"] == "ready"

    ok = httpx.patch(f"{admin}/admin/config", headers=auth, json={"max_widgets": 9})
    assert ok.status_code == 200 and ok.json()["config"]["max_widgets"] == 9
    out_of_range = httpx.patch(f"{admin}/admin/config", headers=auth,
                               json={"max_widgets": 0, "label": "x"})
    assert out_of_range.status_code == 400
    assert "max_widgets" in out_of_range.json()["error"]["message"]
    unknown = httpx.patch(f"{admin}/admin/config", headers=auth, json={"max_widgts": 3})
    assert unknown.status_code == 400 and "max_widgts" in unknown.json()["error"]["message"]
    state = httpx.get(f"{admin}/admin/state", headers=auth).json()
    # The rejected patches changed nothing, not even the valid half of the mixed one.
    assert state["details"] == {"max_widgets": 9, "changes": ["max_widgets"], "calls": []}


def test_sigterm_shuts_down_cleanly(probe: dict[str, object]) -> None:
    proc = probe["proc"]
    proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
    assert proc.wait(15) == 0  # type: ignore[attr-defined]
    log = Path(str(probe["log"])).read_text()
    assert "stopped" in log and "Traceback" not in log


def test_shared_client_channels_send_the_token(probe: dict[str, object]) -> None:
    import asyncio

    from services.common.grpc_client import aio_channel, sync_channel

    with sync_channel(str(probe["grpc"]), GRPC_TOKEN) as channel:
        reply = trainer_pb2_grpc.TrainerStub(channel).GetStatus(
            common_pb2.StatusRequest(), timeout=5
        )
    assert reply.service == "probe"

    async def via_aio() -> str:
        async with aio_channel(str(probe["grpc"]), GRPC_TOKEN) as channel:
            status = await trainer_pb2_grpc.TrainerStub(channel).GetStatus(
                common_pb2.StatusRequest(), timeout=5
            )
            return status.service

    assert asyncio.run(via_aio()) == "probe"
