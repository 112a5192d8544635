"""Bad input on every admin REST endpoint of a real router process, driven by its OpenAPI
schema (hypothesis): whatever the body, the answer is a success or a 4xx in the one error
envelope with a short message, never a 5xx; without the token it is 401 before the body is
read; rejected patches change nothing and the router keeps routing."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.testing.router_process import ADMIN_TOKEN, RouterProcess, router_with_engine
from services.testing.sim_engine_process import SimEngineProcess

JSON = {"content-type": "application/json"}
MAX_MESSAGE_CHARS = 2100
_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
json_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=20), inner, max_size=4),
                           max_leaves=12)


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[RouterProcess, SimEngineProcess]]:
    with router_with_engine(wait_for_target_s=2.0) as running:
        yield running


def _operations(router: RouterProcess) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, body schema) of every operation the admin app's OpenAPI lists."""
    spec = httpx.get(f"{router.admin_url}/openapi.json").raise_for_status().json()
    schemas = spec.get("components", {}).get("schemas", {})
    found = []
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            body = operation.get("requestBody", {}).get("content", {})
            schema = body.get("application/json", {}).get("schema", {})
            if "$ref" in schema:
                schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
            found.append((method.upper(), path, schema))
    return found


def _bodies(schema: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Request bodies for `schema`: its own keys with any values, any JSON, broken JSON."""
    keys = sorted(schema.get("properties", {})) or ["x"]
    shaped = st.dictionaries(st.sampled_from(keys), json_values, max_size=len(keys))
    encoded = (shaped | json_values).map(lambda v: json.dumps(v, allow_nan=True).encode())
    broken = st.sampled_from([b"{", b"[1,", b'{"a": NaN}', b"\xff\xfe", b"null",
                              b"[" * 5000 + b"]" * 5000, b'{"x": -Infinity}'])
    return encoded | broken | st.binary(max_size=64)


def _check_envelope(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"type", "message"}, response.text[:300]
        assert len(error["message"]) < MAX_MESSAGE_CHARS, error["message"][:300]


def _config(router: RouterProcess) -> dict[str, Any]:
    return dict(router.admin.patch("/admin/config", json={}).raise_for_status().json())


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_endpoint_answers_bad_bodies_in_the_envelope(
        router: tuple[RouterProcess, SimEngineProcess], data: st.DataObject) -> None:
    proc, _ = router
    method, path, schema = data.draw(st.sampled_from(_operations(proc)), label="operation")
    body = data.draw(_bodies(schema), label="body")
    before = _config(proc)
    response = proc.admin.request(method, path, content=body, headers=JSON)
    _check_envelope(response)
    if path == "/admin/config" and response.status_code != 200:
        assert _config(proc) == before  # a rejected patch is all-or-nothing
    if path == "/admin/pause" and response.status_code == 200:
        proc.admin.post("/admin/resume").raise_for_status()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_without_the_token_every_admin_endpoint_is_401(
        router: tuple[RouterProcess, SimEngineProcess], data: st.DataObject) -> None:
    proc, _ = router
    ops = [op for op in _operations(proc) if op[1].startswith("/admin/")]
    method, path, schema = data.draw(st.sampled_from(ops), label="operation")
    header = data.draw(st.sampled_from([{}, {"authorization": "Bearer wrong"},
                                        {"authorization": ADMIN_TOKEN}]), label="auth")
    response = httpx.request(method, proc.admin_url + path, headers=header,
                             content=data.draw(_bodies(schema), label="body"))
    assert response.status_code == 401, (method, path, response.text[:200])
    assert response.json()["error"]["type"] == "Unauthenticated"


def test_router_keeps_routing_after_the_bad_input(
        router: tuple[RouterProcess, SimEngineProcess]) -> None:
    proc, engine = router
    assert [t["engine_url"] for t in proc.targets()] == [engine.url]
    assert len(proc.generate("after-admin-fuzz", [1, 2], max_new_tokens=3).output_ids) == 3


@pytest.mark.parametrize(("body", "says"), [
    ('{"max_load_skew": Infinity}', "Infinity is not a JSON number"),
    ('{"max_load_skew": NaN}', "NaN is not a JSON number"),
    ('{"max_load_skew": 1e400}', "1e400 is beyond the range of a float"),
    ('{"num_virtual_nodes": "8"}', "valid integer"),
    ('{"num_virtual_nodes": true}', "valid integer"),
    ('{"num_virtual_nodes": 1000000000}', "less than or equal"),
    ('{"max_retries": 2.5}', "valid integer"),
    (json.dumps({"x" * 1_000_000: 1}), "not tunable live"),
])
def test_live_patches_are_strict_and_errors_short(
        router: tuple[RouterProcess, SimEngineProcess], body: str, says: str) -> None:
    proc, _ = router
    before = _config(proc)
    response = proc.admin.patch("/admin/config", content=body, headers=JSON)
    assert response.status_code == 400, response.text[:300]
    message = response.json()["error"]["message"]
    assert says in message and len(message) < 500, message[:500]
    assert _config(proc) == before


def test_nested_invalid_and_unknown_requests_stay_in_the_envelope(
        router: tuple[RouterProcess, SimEngineProcess]) -> None:
    proc, _ = router
    deep = proc.admin.patch("/admin/config", content=b"[" * 100_000 + b"]" * 100_000,
                            headers=JSON)
    assert deep.status_code == 400 and "nested deeper" in deep.json()["error"]["message"]
    broken = proc.admin.patch("/admin/config", content=b'{"policy": ', headers=JSON)
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    missing = proc.admin.get("/admin/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFound"
    wrong = proc.admin.delete("/admin/state")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "MethodNotAllowed"


def _raw_request(url: str, head: str) -> bytes:
    """Send only the request head (no body byte) and read the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not _complete(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    length = [line.split(b":")[1] for line in head.lower().split(b"\r\n")
              if line.startswith(b"content-length:")]
    return bool(length) and len(body) >= int(length[0])


def test_token_and_size_are_checked_before_the_body_is_read(
        router: tuple[RouterProcess, SimEngineProcess]) -> None:
    proc, _ = router
    head = ("PATCH /admin/config HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 300000000\r\n{auth}\r\n")
    # The answers come while 300 MB are still unsent: nothing waited for the body.
    denied = _raw_request(proc.admin_url, head.format(auth=""))
    assert denied.startswith(b"HTTP/1.1 401") and b"Unauthenticated" in denied
    too_big = _raw_request(proc.admin_url,
                           head.format(auth=f"Authorization: Bearer {ADMIN_TOKEN}\r\n"))
    assert too_big.startswith(b"HTTP/1.1 413") and b"PayloadTooLarge" in too_big

    def chunks() -> Iterator[bytes]:  # no Content-Length: capped while reading
        for _ in range(3):
            yield b" " * (1 << 20)

    streamed = proc.admin.patch("/admin/config", content=chunks())
    assert streamed.status_code == 413, streamed.text[:200]
