"""The engine's API key, as SGLang's --api-key: without the bearer key (or with a wrong one)
every route but /health* and /metrics answers 401 `{"error": "Unauthorized"}` before the body
is read; with it the route answers as usual; the key never shows in /server_info. The key
comes from --api-key, engine.api_key or the launcher's environment variable."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.common.engine_contract import API_KEY_ENV, bearer
from services.engine.cli import parse_args
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.http_server import create_app

KEY = "k3y-for-the-engine-test"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from services.common.tiny_model import create_tiny_model

    model = create_tiny_model(tmp_path_factory.mktemp("m") / "model", hidden_size=32,
                              num_layers=1)
    engine = Engine(EngineConfig(model_path=str(model), api_key=KEY))
    engine.start()
    try:
        with TestClient(create_app(engine)) as test_client:
            yield test_client
    finally:
        engine.stop()


GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key-123"},
                                     {"Authorization": KEY}, {"Authorization": f"bearer {KEY}"}])
def test_refused_without_the_right_key(client: TestClient, headers: dict[str, str]) -> None:
    for method, path in [("POST", "/generate"), ("GET", "/model_info"), ("GET", "/server_info"),
                         ("POST", "/pause_generation"), ("POST", "/update_weight_version"),
                         ("POST", "/init_weights_update_group"), ("GET", "/v1/loads")]:
        reply = client.request(method, path, json=GENERATE, headers=headers)
        assert reply.status_code == 401, (path, reply.text)
        assert reply.json() == {"error": "Unauthorized"}


def test_refused_before_the_body_is_read(client: TestClient) -> None:
    reply = client.post("/generate", content=b"{not json", headers={"content-type":
                                                                     "application/json"})
    assert reply.status_code == 401  # not the 400 a malformed body gets


def test_answers_with_the_key(client: TestClient) -> None:
    reply = client.post("/generate", json=GENERATE, headers=bearer(KEY))
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["output_ids"]) == 2
    info = client.get("/server_info", headers=bearer(KEY))
    assert info.status_code == 200
    assert KEY not in info.text and "api_key" not in info.json()


def test_health_and_metrics_need_no_key(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_key_from_flag_file_or_environment(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert parse_args(["--model", "m"])[0].api_key is None
    assert parse_args(["--model", "m", "--api-key", KEY])[0].api_key == KEY
    config = tmp_path / "d.toml"
    config.write_text(f'[engine]\napi_key = "{KEY}"\n')
    assert parse_args(["--model", "m", "--config", str(config)])[0].api_key == KEY
    monkeypatch.setenv(API_KEY_ENV, "from-the-environment")
    assert parse_args(["--model", "m"])[0].api_key == "from-the-environment"
    assert parse_args(["--model", "m", "--api-key", KEY])[0].api_key == KEY
    assert "from-the-environment" not in repr(parse_args(["--model", "m"])[0])
