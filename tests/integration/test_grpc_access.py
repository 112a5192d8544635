"""Every gRPC method of every service in protos/riptide/v1: without the token, or with a wrong
one, it is refused with UNAUTHENTICATED before any handler runs; with it, a malformed message
or a NaN gets INVALID_ARGUMENT, and the service goes on serving. The probe service records
which handlers ran; the real router shows that out-of-range calls change nothing."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services._proto.riptide.v1 import (
    common_pb2,
    rollout_pb2,
    router_pb2,
    router_pb2_grpc,
    sandbox_pb2,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.common.grpc_client import aio_channel, sync_channel
from services.common.grpc_server import call_metadata
from services.testing.probe_service import ProbeProcess, probe_process
from services.testing.router_process import RouterProcess, router_with_engine
from services.testing.sim_engine_process import SimEngineProcess

ADMIN, TOKEN = "admin-token-access", "grpc-token-access"
METHODS = [m for module in (router_pb2, rollout_pb2, sandbox_pb2, trainer_pb2)
           for service in module.DESCRIPTOR.services_by_name.values()
           for m in service.methods]
#: Not a protobuf: a field tag whose length runs past the end.
MALFORMED = b"\x0a\xff\xff\xff\x0f\x01"


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProbeProcess]:
    with probe_process(tmp_path_factory.mktemp("probe"), ADMIN, TOKEN) as running:
        yield running


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _call(channel: grpc.Channel, method: MethodDescriptor, payload: bytes,
          metadata: Any = ()) -> Any:
    """Call `method` with raw request bytes in its own streaming shape; returns the replies."""
    kind = (method.client_streaming, method.server_streaming)
    path, args = _path(method), {"timeout": 10, "metadata": metadata}
    if kind == (False, False):
        return [channel.unary_unary(path)(payload, **args)]
    if kind == (False, True):
        return list(channel.unary_stream(path)(payload, **args))
    if kind == (True, False):
        return [channel.stream_unary(path)(iter([payload]), **args)]
    return list(channel.stream_stream(path)(iter([payload]), **args))


def _calls(probe: ProbeProcess) -> list[str]:
    with grpc.insecure_channel(probe.grpc) as channel:
        status = trainer_pb2_grpc.TrainerStub(channel).GetStatus(
            common_pb2.StatusRequest(), timeout=5, metadata=call_metadata(TOKEN))
    return list(status.details["calls"])


@pytest.mark.parametrize("method", METHODS, ids=_path)
def test_calls_without_the_right_token_are_refused_before_any_handler(
        probe: ProbeProcess, method: MethodDescriptor) -> None:
    before = _calls(probe)
    with grpc.insecure_channel(probe.grpc) as channel:
        for metadata in ((), call_metadata("wrong-token"), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as refused:
                _call(channel, method, b"", metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, method.full_name
    assert _calls(probe) == before


@pytest.mark.parametrize("method", METHODS, ids=_path)
def test_malformed_messages_are_invalid_arguments(
        probe: ProbeProcess, method: MethodDescriptor) -> None:
    before = _calls(probe)
    with grpc.insecure_channel(probe.grpc) as channel:
        with pytest.raises(grpc.RpcError) as rejected:
            _call(channel, method, MALFORMED, call_metadata(TOKEN))
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid message" in rejected.value.details()
    assert _calls(probe) == before


def test_with_the_token_every_method_reaches_its_handler(probe: ProbeProcess) -> None:
    """The counterpart of the refusals above: the same calls, authorised, get through."""
    recording = [m for m in METHODS if m.containing_service.name in ("Router", "Rollout")]
    empty_update = rollout_pb2.WeightUpdateRequest(commit=rollout_pb2.WeightUpdateCommit())
    with grpc.insecure_channel(probe.grpc) as channel:
        for method in recording:
            payload = empty_update.SerializeToString() if method.client_streaming else b""
            _call(channel, method, payload, call_metadata(TOKEN))
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # open without a token
    reached = _calls(probe)[-len(recording):]
    names = [m.name if m.name != "GetStatus" else f"{m.containing_service.name}.GetStatus"
             for m in recording]
    assert reached == names


async def _aio_call(channel: grpc.aio.Channel, method: MethodDescriptor, payload: bytes) -> None:
    kind, path = (method.client_streaming, method.server_streaming), _path(method)
    if kind == (False, False):
        await channel.unary_unary(path)(payload, timeout=10)
    elif kind == (False, True):
        async for _ in channel.unary_stream(path)(payload, timeout=10):
            pass
    elif kind == (True, False):
        await channel.stream_unary(path)(iter([payload]), timeout=10)
    else:
        async for _ in channel.stream_stream(path)(iter([payload]), timeout=10):
            pass


def test_riptide_channels_send_the_token_on_every_call_shape(probe: ProbeProcess) -> None:
    """The channels services use (no metadata given by the caller) carry the token on unary
    and streaming calls alike, asyncio and blocking."""
    import asyncio

    recording = [m for m in METHODS if m.containing_service.name in ("Router", "Rollout")]
    assert {(m.client_streaming, m.server_streaming) for m in recording} >= {
        (False, False), (True, True)}
    empty_update = rollout_pb2.WeightUpdateRequest(commit=rollout_pb2.WeightUpdateCommit())

    def payload(method: MethodDescriptor) -> bytes:
        return empty_update.SerializeToString() if method.client_streaming else b""

    async def through_aio() -> None:
        channel = aio_channel(probe.grpc, TOKEN)
        try:
            for method in recording:
                await _aio_call(channel, method, payload(method))
        finally:
            await channel.close()

    names = [m.name if m.name != "GetStatus" else f"{m.containing_service.name}.GetStatus"
             for m in recording]
    asyncio.run(through_aio())
    assert _calls(probe)[-len(recording):] == names
    channel = sync_channel(probe.grpc, TOKEN)
    for method in recording:
        _call(channel, method, payload(method))
    channel.close()
    assert _calls(probe)[-len(recording):] == names


def test_non_finite_numbers_anywhere_in_a_message_are_refused(probe: ProbeProcess) -> None:
    nan_deep = router_pb2.GenerateRequest(
        input_ids=[1], sampling_params=common_pb2.SamplingParams(top_p=math.nan))
    method = router_pb2.DESCRIPTOR.services_by_name["Router"].methods_by_name["Generate"]
    before = _calls(probe)
    with grpc.insecure_channel(probe.grpc) as channel:
        with pytest.raises(grpc.RpcError) as rejected:
            _call(channel, method, nan_deep.SerializeToString(), call_metadata(TOKEN))
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.top_p: must be a finite number" in rejected.value.details()
    assert _calls(probe) == before


#: The longest prompt the router's engine takes (its server info's max_req_input_len).
PROMPT_CAP = 4096


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[RouterProcess, SimEngineProcess]]:
    with router_with_engine(grpc_token=TOKEN, engine_settings={"max_input_tokens": PROMPT_CAP},
                            wait_for_target_s=2.0) as running:
        yield running


def _status(router: RouterProcess) -> tuple[Any, list[str]]:
    body = router.admin.get("/admin/targets").raise_for_status().json()
    return body["weight_version"], sorted(t["id"] for t in body["targets"])


def test_router_refuses_out_of_range_calls_and_keeps_serving(
        router: tuple[RouterProcess, SimEngineProcess]) -> None:
    proc, engine = router
    stub = proc.stub()
    before = _status(proc)
    sampling = common_pb2.SamplingParams
    bad: list[tuple[str, Any]] = [
        ("SetWeightVersion", router_pb2.SetWeightVersionRequest(weight_version=-5)),
        ("RegisterEngine", router_pb2.RegisterEngineRequest(url="ftp://" + "x" * 100_000)),
        ("RegisterEngine", router_pb2.RegisterEngineRequest(url="")),
        ("Generate", router_pb2.GenerateRequest(input_ids=[])),
        ("Generate", router_pb2.GenerateRequest(input_ids=[-3])),
        ("Generate", router_pb2.GenerateRequest(input_ids=[1], sampling_params=sampling(
            temperature=-1))),
        ("Generate", router_pb2.GenerateRequest(input_ids=[1], sampling_params=sampling(
            top_p=5))),
        ("Generate", router_pb2.GenerateRequest(input_ids=[1], sampling_params=sampling(
            top_k=-7))),
        # what an operator's probe found accepted
        ("Generate", router_pb2.GenerateRequest(session_key="k" * 1_000_000, input_ids=[1])),
        ("Generate", router_pb2.GenerateRequest(session_key="a\nb", input_ids=[1])),
        ("Generate", router_pb2.GenerateRequest(request_id="r" * 100_000, input_ids=[1])),
        ("Generate", router_pb2.GenerateRequest(
            input_ids=[1], sglang_fields_json='{"lora_path": "' + "x" * 1_000_000 + '"}')),
        ("Generate", router_pb2.GenerateRequest(input_ids=[1], sampling_params=sampling(
            max_new_tokens=0))),
        ("Generate", router_pb2.GenerateRequest(input_ids=[1] * (PROMPT_CAP + 1))),
        ("EndSession", router_pb2.EndSessionRequest(session_key="k" * 1_000_000)),
    ]
    for name, request in bad:
        with pytest.raises(grpc.RpcError) as rejected:
            getattr(stub, name)(request, timeout=10)
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, request)
        assert len(rejected.value.details()) < 300, rejected.value.details()[:300]
    with pytest.raises(grpc.RpcError) as unknown:
        stub.DeregisterEngine(router_pb2.DeregisterEngineRequest(url="http://nowhere:1"),
                              timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert _status(proc) == before  # nothing changed
    reply = proc.generate("after-bad-input", [1, 2, 3], max_new_tokens=4, timeout_s=20)
    assert len(reply.output_ids) == 4 and reply.engine_url == engine.url


def test_router_refuses_a_huge_prompt_at_once_and_unset_max_new_tokens_is_the_default(
        router: tuple[RouterProcess, SimEngineProcess]) -> None:
    """A prompt past the engines' context is refused before routing, with a message that
    quotes no token; an unset max_new_tokens is the engine's default (the sim's 128), an
    explicit one is what is generated."""
    proc, engine = router
    stub = proc.stub()
    huge = router_pb2.GenerateRequest(session_key="huge", input_ids=[7] * 5_000_000)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as rejected:
        stub.Generate(huge, timeout=30)
    took = time.monotonic() - started
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rejected.value.details() == (
        f"input_ids: 5000000 tokens, more than the model's context takes ({PROMPT_CAP} "
        "prompt tokens at most, as the engines report)")
    assert took < 5.0, took
    assert stub.Generate(router_pb2.GenerateRequest(session_key="fits", input_ids=[7] * PROMPT_CAP,
                                                    sampling_params=common_pb2.SamplingParams(
                                                        max_new_tokens=1)), timeout=30).output_ids
    unset = stub.Generate(router_pb2.GenerateRequest(session_key="unset", input_ids=[3]),
                          timeout=30)
    assert len(unset.output_ids) == 128
    assert "max_new_tokens" not in engine.last_request()["sampling_params"]
    one = stub.Generate(router_pb2.GenerateRequest(
        session_key="one", input_ids=[3], sampling_params=common_pb2.SamplingParams(
            max_new_tokens=1)), timeout=30)
    assert len(one.output_ids) == 1


def test_router_mutations_without_the_token_change_nothing(
        router: tuple[RouterProcess, SimEngineProcess]) -> None:
    proc, engine = router
    before = _status(proc)
    with grpc.insecure_channel(proc.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for name, request in (
            ("SetWeightVersion", router_pb2.SetWeightVersionRequest(weight_version=99)),
            ("DeregisterEngine", router_pb2.DeregisterEngineRequest(url=engine.url)),
            ("RegisterEngine", router_pb2.RegisterEngineRequest(url="http://127.0.0.1:9")),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                getattr(stub, name)(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _status(proc) == before
    assert len(proc.generate("still-routed", [5], max_new_tokens=2).output_ids) == 2
