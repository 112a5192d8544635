"""A stand-in for Daytona's REST API, backed by local (bubblewrap) sandboxes, for tests and benches.

It serves the subset of the API that the real `daytona` SDK calls for Riptide's provider:
control plane under `/api` (sandbox create/get/delete/start/stop, list by labels in cursor
pages, label replacement, toolbox proxy URL, snapshots get/create) and the toolbox under
`/toolbox/{id}` (daytona_toolbox.py), speaking the SDK's own wire format so that the real
client code runs. A sandbox's image is resolved
to a task of `--tasks-dir`: a task whose `docker_image` is that image, or whose name is the
image's last path component (`riptide-tasks/hello:latest` -> task `hello`); the local
provider then builds the sandbox from that task's environment. Test controls under `/_test`
inject HTTP 429 answers to creates and report counts. Run it as its own process:
`python -m services.testing.daytona_server --port P --tasks-dir DIR --api-key KEY`.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from services.sandbox.dockerfile import parse_dockerfile
from services.sandbox.provider import SandboxHandle
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import Task, TaskSet
from services.testing.daytona_toolbox import Session, error, toolbox_routes

ORGANIZATION_ID = "riptide-test-org"
LIST_PAGE_SIZE = 100


def _now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class SandboxRecord:
    id: str
    handle: SandboxHandle
    body: dict[str, Any]
    snapshot: str | None
    created_at: str = field(default_factory=_now)
    state: str = "started"
    sessions: dict[str, Session] = field(default_factory=dict)


class DaytonaStandIn:
    """The server's state: tasks, local sandboxes behind Daytona ids, snapshots, controls."""

    def __init__(self, tasks: TaskSet, api_key: str, local_root: Path | None = None) -> None:
        self.tasks = tasks
        self.api_key = api_key
        self.provider = LocalProvider(LocalProviderConfig(root_dir=local_root))
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.snapshots: dict[str, dict[str, Any]] = {}
        self.base_url = ""
        self.counts = {"create_requests": 0, "creates": 0, "rejected": 0, "deletes": 0,
                       "snapshot_creates": 0, "list_requests": 0, "label_updates": 0}
        self.reject_next_creates = 0
        self.created_labels: list[dict[str, str]] = []

    def task_for_image(self, image: str) -> Task | None:
        for task in self.tasks:
            if task.config.environment.docker_image == image:
                return task
        name = image.rsplit("/", 1)[-1].split("@", 1)[0].split(":", 1)[0]
        return self.tasks.get(name) if name in self.tasks else None

    def sandbox_dto(self, record: SandboxRecord) -> dict[str, Any]:
        body = record.body
        return {
            "id": record.id, "organizationId": ORGANIZATION_ID,
            "name": body.get("name") or record.id, "snapshot": record.snapshot, "user": "root",
            "env": body.get("env") or {}, "labels": body.get("labels") or {}, "public": False,
            "networkBlockAll": bool(body.get("networkBlockAll")), "kvm": False,
            "target": body.get("target") or "local", "cpu": body.get("cpu") or 1, "gpu": 0,
            "memory": body.get("memory") or 1, "disk": body.get("disk") or 1,
            "state": record.state, "autoStopInterval": body.get("autoStopInterval"),
            "autoDeleteInterval": body.get("autoDeleteInterval"),
            "createdAt": record.created_at, "updatedAt": _now(),
            "toolboxProxyUrl": f"{self.base_url}/toolbox",
        }

    def snapshot_dto(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": snapshot["id"], "organizationId": ORGANIZATION_ID, "general": False,
            "name": snapshot["name"], "imageName": snapshot["image"], "state": "active",
            "size": None, "entrypoint": None, "cpu": snapshot.get("cpu") or 1, "gpu": 0,
            "mem": snapshot.get("memory") or 1, "disk": snapshot.get("disk") or 1,
            "errorReason": None, "createdAt": snapshot["created_at"],
            "updatedAt": snapshot["created_at"], "lastUsedAt": None, "sourceSandboxId": None,
        }


def _image_of(body: dict[str, Any]) -> str | None:
    if body.get("imageName"):
        return str(body["imageName"])
    dockerfile = (body.get("buildInfo") or {}).get("dockerfileContent")
    return parse_dockerfile(dockerfile).base_image if dockerfile else None


def build_app(state: DaytonaStandIn) -> FastAPI:
    """The FastAPI app: /api (control plane), /toolbox (per sandbox), /_test (controls)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.provider.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith(("/api/", "/toolbox/")):
            sent = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(sent, f"Bearer {state.api_key}".encode()):
                return error(401, "missing or wrong API key")
        response: Response = await call_next(request)
        return response

    @app.post("/api/sandbox")
    async def create_sandbox(body: dict[str, Any]) -> Response:
        state.counts["create_requests"] += 1
        if state.reject_next_creates > 0:
            state.reject_next_creates -= 1
            state.counts["rejected"] += 1
            response = error(429, "Rate limit exceeded: too many sandbox creations")
            response.headers["Retry-After"] = "0"
            return response
        snapshot = state.snapshots.get(body.get("snapshot") or "")
        if body.get("snapshot") and snapshot is None:
            return error(404, f"snapshot {body['snapshot']} not found")
        image = snapshot["image"] if snapshot else _image_of(body)
        task = state.task_for_image(image) if image else None
        if task is None:
            return error(400, f"cannot resolve image {image!r} to a task of the stand-in")
        # The labels stay with the stand-in's record: its local sandboxes are its own
        # business, never listed by a local provider of the run under test.
        handle = await state.provider.create(task)
        record = SandboxRecord(handle.sandbox_id, handle, body,
                               snapshot["name"] if snapshot else None)
        state.sandboxes[record.id] = record
        state.counts["creates"] += 1
        state.created_labels.append(dict(body.get("labels") or {}))
        return JSONResponse(state.sandbox_dto(record))

    def record_of(sandbox_id: str) -> SandboxRecord | None:
        record = state.sandboxes.get(sandbox_id)
        if record is None:
            record = next((r for r in state.sandboxes.values()
                           if r.body.get("name") == sandbox_id), None)
        return record

    @app.get("/api/sandbox/{sandbox_id}")
    async def get_sandbox(sandbox_id: str) -> Response:
        record = record_of(sandbox_id)
        if record is None:
            return error(404, f"sandbox {sandbox_id} not found")
        return JSONResponse(state.sandbox_dto(record))

    @app.get("/api/sandbox")
    async def list_sandboxes(labels: str | None = None, cursor: str | None = None,
                             limit: int = LIST_PAGE_SIZE) -> Response:
        # As Daytona: `labels` a JSON object every match carries, newest first, pages of
        # `limit` with an opaque `nextCursor` (null on the last page).
        try:
            wanted = json.loads(labels) if labels else {}
            start = int(cursor) if cursor else 0
        except ValueError:
            return error(400, "labels must be a JSON object and cursor one this server gave")
        if not isinstance(wanted, dict) or not 1 <= limit <= 200:
            return error(400, "labels must be a JSON object; limit in [1, 200]")
        matches = [r for r in reversed(state.sandboxes.values())
                   if all((r.body.get("labels") or {}).get(k) == v for k, v in wanted.items())]
        page = matches[start:start + limit]
        state.counts["list_requests"] += 1
        more = start + limit < len(matches)
        return JSONResponse({"items": [state.sandbox_dto(r) for r in page],
                             "nextCursor": str(start + limit) if more else None})

    @app.put("/api/sandbox/{sandbox_id}/labels")
    async def replace_labels(sandbox_id: str, body: dict[str, Any]) -> Response:
        record = record_of(sandbox_id)
        if record is None:
            return error(404, f"sandbox {sandbox_id} not found")
        labels = body.get("labels")
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            return error(400, "labels must be an object of strings")
        record.body["labels"] = dict(labels)
        state.counts["label_updates"] += 1
        return JSONResponse({"labels": record.body["labels"]})

    @app.delete("/api/sandbox/{sandbox_id}")
    async def delete_sandbox(sandbox_id: str) -> Response:
        record = record_of(sandbox_id)
        if record is None:
            return error(404, f"sandbox {sandbox_id} not found")
        await state.provider.delete(record.handle)
        state.sandboxes.pop(record.id, None)
        state.counts["deletes"] += 1
        record.state = "destroyed"
        return JSONResponse(state.sandbox_dto(record))

    @app.post("/api/sandbox/{sandbox_id}/{action}")
    async def lifecycle(sandbox_id: str, action: str) -> Response:
        record = record_of(sandbox_id)
        if record is None:
            return error(404, f"sandbox {sandbox_id} not found")
        if action not in ("start", "stop"):
            return error(404, f"action {action} is not served by the stand-in")
        record.state = "started" if action == "start" else "stopped"
        return JSONResponse(state.sandbox_dto(record))

    @app.get("/api/sandbox/{sandbox_id}/toolbox-proxy-url")
    async def toolbox_url(sandbox_id: str) -> dict[str, str]:
        return {"url": f"{state.base_url}/toolbox"}

    @app.get("/api/snapshots/{name}")
    async def get_snapshot(name: str) -> Response:
        snapshot = state.snapshots.get(name) or next(
            (s for s in state.snapshots.values() if s["id"] == name), None)
        if snapshot is None:
            return error(404, f"snapshot {name} not found")
        return JSONResponse(state.snapshot_dto(snapshot))

    @app.post("/api/snapshots")
    async def create_snapshot(body: dict[str, Any]) -> Response:
        if body["name"] in state.snapshots:
            return error(409, f"snapshot {body['name']} already exists")
        image = _image_of(body)
        if image is None or state.task_for_image(image) is None:
            return error(400, f"cannot resolve image {image!r} to a task of the stand-in")
        state.counts["snapshot_creates"] += 1
        snapshot = {"id": uuid.uuid4().hex, "name": body["name"], "image": image,
                    "cpu": body.get("cpu"), "memory": body.get("memory"),
                    "disk": body.get("disk"), "created_at": _now()}
        state.snapshots[body["name"]] = snapshot
        return JSONResponse(state.snapshot_dto(snapshot))

    @app.post("/_test/reject-creates")
    async def reject_creates(body: dict[str, int]) -> dict[str, int]:
        state.reject_next_creates = int(body["count"])
        return {"reject_next_creates": state.reject_next_creates}

    @app.get("/_test/state")
    async def test_state() -> dict[str, Any]:
        return {**state.counts, "sandboxes": len(state.sandboxes),
                "local_sandboxes": state.provider.stats()["sandboxes_alive"],
                "snapshots": sorted(state.snapshots), "created_labels": state.created_labels,
                "live_labels": {r.id: r.body.get("labels") or {}
                                for r in state.sandboxes.values()}}

    app.include_router(toolbox_routes(state), prefix="/toolbox")
    return app


class DaytonaServer:
    """The stand-in as a child process on a free loopback port; a context manager."""

    def __init__(self, tasks_dir: Path | str, api_key: str = "riptide-test-key",
                 start_timeout_s: float = 30.0) -> None:
        self.tasks_dir, self.api_key, self.start_timeout_s = Path(tasks_dir), api_key, \
            start_timeout_s
        self.port = 0
        self.proc: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def start(self) -> DaytonaServer:
        import sys

        import httpx

        from services.common.ports import free_port
        from services.common.process import spawn

        self.port = free_port()
        self.proc = spawn([sys.executable, "-m", "services.testing.daytona_server",
                           "--port", str(self.port), "--tasks-dir", str(self.tasks_dir),
                           "--api-key", self.api_key])
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daytona stand-in exited with {self.proc.returncode}")
            try:
                httpx.get(f"{self.url}/_test/state", timeout=1.0).raise_for_status()
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"daytona stand-in not up after {self.start_timeout_s} s")

    def state(self) -> dict[str, Any]:
        import httpx

        return dict(httpx.get(f"{self.url}/_test/state", timeout=10.0).json())

    def reject_next_creates(self, count: int) -> None:
        import httpx

        httpx.post(f"{self.url}/_test/reject-creates", json={"count": count},
                   timeout=10.0).raise_for_status()

    def stop(self) -> None:
        from services.common.process import stop

        if self.proc is not None:
            stop(self.proc, grace_s=10.0)
            self.proc = None

    def __enter__(self) -> DaytonaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tasks-dir", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--local-root", default=None, help="where the local sandboxes live")
    args = parser.parse_args()
    state = DaytonaStandIn(TaskSet.load(args.tasks_dir), args.api_key,
                           Path(args.local_root) if args.local_root else None)
    state.base_url = f"http://{args.host}:{args.port}"
    started = time.monotonic()
    print(f"daytona stand-in on {state.base_url} ({len(state.tasks)} tasks, "
          f"{time.monotonic() - started:.2f} s)", flush=True)
    uvicorn.run(build_app(state), host=args.host, port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
