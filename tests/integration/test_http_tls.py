"""The services' HTTP listeners over TLS (`[run.http_tls]`): a real router process serves its
admin REST port and its SGLang-compatible HTTP front with the cluster certificate of
`riptide tls-cert`. A client trusting the CA is served (the admin token and the engine key
still required); plain HTTP and a client trusting another CA are not. The agent gateway's
client (services/common/http1_client.py) reaches the front over TLS, and refuses an https URL
without the deployment's CA."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services._proto.riptide.v1 import common_pb2
from services.common.config import HttpTlsConfig
from services.common.errors import ConfigError, Unavailable
from services.common.tls import client_context, server_context
from services.sandbox.engine_model_client import EngineModelClient
from services.testing.loopback_tls import loopback_tls
from services.testing.router_process import RouterProcess
from services.testing.sim_engine_process import SimEngineProcess

ENGINE_KEY = "engine-key-over-tls"


def _tls(out: Path) -> HttpTlsConfig:
    return loopback_tls(out, HttpTlsConfig)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    engine = SimEngineProcess()
    try:
        process = RouterProcess(http_front=True, engine_api_key=ENGINE_KEY,
                                http_tls=_tls(tmp_path_factory.mktemp("tls")),
                                engine_urls=[engine.url])
        try:
            yield process
        finally:
            process.stop()
    finally:
        engine.stop()


def test_admin_over_tls_serves_a_client_trusting_the_ca(router: RouterProcess) -> None:
    assert router.admin_url.startswith("https://")
    assert router.admin.get("/admin/state").status_code == 200
    unauthenticated = httpx.get(f"{router.admin_url}/admin/state", verify=router.verify)
    assert unauthenticated.status_code == 401  # TLS is no substitute for the token


def test_admin_refuses_plain_http_and_another_ca(router: RouterProcess, tmp_path: Path) -> None:
    plain = router.admin_url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/readyz", timeout=5)
    other = _tls(tmp_path / "other")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{router.admin_url}/readyz", verify=client_context(other), timeout=5)


def test_the_http_front_over_tls_routes_the_gateways_calls(router: RouterProcess) -> None:
    assert router.http_tls is not None and router.http_url.startswith("https://")

    async def call(context: ssl.SSLContext | None) -> list[int]:
        client = EngineModelClient(router.http_url, 10.0, ENGINE_KEY, routed=True,
                                   num_retries=0, ssl_context=context)
        try:
            result = await client.generate("episode-tls", [5, 6, 7],
                                           common_pb2.SamplingParams(max_new_tokens=3))
            return list(result.output_ids)
        finally:
            await client.close()

    assert len(asyncio.run(call(client_context(router.http_tls)))) == 3
    with pytest.raises(Unavailable, match="https needs the deployment's CA"):
        asyncio.run(call(None))


def test_unreadable_tls_files_name_their_key(tmp_path: Path) -> None:
    missing = HttpTlsConfig(cert_file=str(tmp_path / "no.pem"), key_file=str(tmp_path / "no"),
                            ca_file=str(tmp_path / "no-ca.pem"))
    with pytest.raises(ConfigError, match="run.http_tls.cert_file"):
        server_context(missing)
    with pytest.raises(ConfigError, match="run.http_tls.ca_file"):
        client_context(missing)
