"""gRPC over TLS (`[run.grpc_tls]`): a real router process serves its gRPC port with the
cluster certificate of `riptide tls-cert`; a client that trusts the CA and carries the token
is served, a plaintext client and a client trusting another CA are not, and the token is
still required over TLS."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services._proto.riptide.v1 import common_pb2, router_pb2_grpc
from services.common.config import GrpcTlsConfig
from services.common.grpc_client import sync_channel
from services.testing.loopback_tls import loopback_tls
from services.testing.router_process import RouterProcess

TOKEN = "grpc-token-over-tls"


def _tls(out: Path) -> GrpcTlsConfig:
    return loopback_tls(out, GrpcTlsConfig)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    tls = _tls(tmp_path_factory.mktemp("tls"))
    process = RouterProcess(grpc_token=TOKEN, grpc_tls=tls)
    try:
        yield process
    finally:
        process.stop()


def _status(channel: grpc.Channel) -> str:
    return str(router_pb2_grpc.RouterStub(channel).GetStatus(common_pb2.StatusRequest(),
                                                             timeout=10).service)


def test_a_client_trusting_the_ca_with_the_token_is_served(router: RouterProcess) -> None:
    with router.channel() as channel:
        assert _status(channel) == "router"


def test_plaintext_is_refused(router: RouterProcess) -> None:
    with sync_channel(router.address, TOKEN) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _status(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_trusting_another_ca_is_refused(router: RouterProcess,
                                                 tmp_path: Path) -> None:
    other = _tls(tmp_path / "other")
    with sync_channel(router.address, TOKEN, tls=other) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _status(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_token_is_still_required_over_tls(router: RouterProcess) -> None:
    assert router.grpc_tls is not None
    with sync_channel(router.address, None, tls=router.grpc_tls) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _status(channel)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
