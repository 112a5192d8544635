"""The dashboard's page and API behind the admin guard, over a saved run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from services.common.admin import build_admin_app
from services.rollout.dashboard.config import DashboardConfig
from services.rollout.dashboard.source import FileSource
from services.rollout.dashboard.standalone import DashboardRuntime
from services.testing.synthetic_events import SyntheticRun, write_jsonl

TOKEN = "dashboard-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = write_jsonl(SyntheticRun(no_verdict_fraction=0.3, live_snapshots=True).generate(),
                       tmp_path_factory.mktemp("events") / "run.jsonl")
    runtime = DashboardRuntime(FileSource(path), DashboardConfig())
    with TestClient(build_admin_app(runtime, TOKEN)) as test_client:
        yield test_client


def test_the_page_and_its_assets_are_served_from_the_package(client: TestClient) -> None:
    page = client.get("/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for asset in ("dashboard.js", "charts.js", "dashboard.css"):
        assert f"/dashboard/static/{asset}" in page.text
        assert client.get(f"/dashboard/static/{asset}").status_code == 200
    missing = client.get("/dashboard/static/secret.txt")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFound"


@pytest.mark.parametrize("path", ["/dashboard/api/summary", "/dashboard/api/samples/x"])
def test_the_api_needs_the_admin_token(client: TestClient, path: str) -> None:
    assert client.get(path).status_code == 401
    assert client.get(path, headers={"Authorization": "Bearer wrong-token"}).status_code == 401


def test_summary_has_every_panel_and_the_advisories(client: TestClient) -> None:
    body = client.get("/dashboard/api/summary", headers=AUTH).json()
    assert body["live"] is False and body["follows"] is False  # a saved run: no polling
    for panel in ("timeline", "concurrency", "cache", "steps", "staleness", "evals",
                  "engines", "sandboxes", "samples"):
        assert body[panel], panel
    assert body["dropped"] == {}  # this run drops no group
    assert {(s["state"], s["provider"]) for s in body["sandboxes"]} == {("running", "local")}
    assert [a["code"] for a in body["advisories"]] == ["no_verdict"]


def test_one_sample_and_a_missing_one(client: TestClient) -> None:
    sample_id = client.get("/dashboard/api/summary", headers=AUTH).json()["samples"][0][
        "sample_id"]
    view = client.get(f"/dashboard/api/samples/{sample_id}", headers=AUTH).json()
    assert view["sample_id"] == sample_id and view["turns"] and view["tokens"]
    missing = client.get("/dashboard/api/samples/nope", headers=AUTH)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]


def test_an_oversized_sample_id_is_refused_before_any_lookup(client: TestClient) -> None:
    refused = client.get(f"/dashboard/api/samples/{'s' * 5000}", headers=AUTH)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "InvalidRequest" and "at most 256 printable" in error["message"]
    assert len(error["message"]) < 200
