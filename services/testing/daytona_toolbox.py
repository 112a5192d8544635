"""The toolbox half of the Daytona stand-in: what the SDK calls at a sandbox's toolboxProxyUrl.

Every path is prefixed by the sandbox id, as the SDK's ToolboxApiClientProxy sends it:
process execute, sessions (create, exec, get command, logs, delete), bulk file upload and
download (multipart both ways), file info, folders, work and home directories. Commands run
in the local (bubblewrap) sandbox behind the Daytona sandbox.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from services.sandbox.provider import SandboxHandle, SandboxProvider

_NO_LIMIT_S = 24 * 3600.0


@dataclass
class SessionCommand:
    id: str
    command: str
    exit_code: int | None = None
    output: str = ""
    job: asyncio.Task[None] | None = None


@dataclass
class Session:
    id: str
    commands: dict[str, SessionCommand] = field(default_factory=dict)


def error(status: int, message: str) -> JSONResponse:
    """An error body in the daemon's shape (the SDK reads `message`)."""
    return JSONResponse({"message": message, "statusCode": status, "error": message},
                        status_code=status)


def _absolute(path: str, workdir: str) -> str:
    return path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"


def toolbox_routes(server: Any) -> APIRouter:
    """Routes under /toolbox/{sandbox_id}; `server` resolves ids to live records."""
    router = APIRouter()
    provider: SandboxProvider = server.provider

    def handle_of(sandbox_id: str) -> SandboxHandle:
        record = server.sandboxes.get(sandbox_id)
        if record is None or record.state != "started":
            raise HTTPException(404, f"sandbox {sandbox_id} not found or not started")
        return record.handle

    @router.post("/{sandbox_id}/process/execute")
    async def execute(sandbox_id: str, body: dict[str, Any]) -> Response:
        handle = handle_of(sandbox_id)
        timeout_s = float(body.get("timeout") or _NO_LIMIT_S)
        result = await provider.exec(handle, body["command"], timeout_s,
                                     cwd=body.get("cwd"), env=body.get("envs"))
        if result.timed_out:
            return error(408, f"command timed out after {timeout_s:g} s")
        return JSONResponse({"exitCode": result.exit_code, "result": result.output})

    @router.post("/{sandbox_id}/process/session", status_code=201)
    async def create_session(sandbox_id: str, body: dict[str, Any]) -> Response:
        handle_of(sandbox_id)
        sessions = server.sandboxes[sandbox_id].sessions
        if body["sessionId"] in sessions:
            return error(409, f"session {body['sessionId']} already exists")
        sessions[body["sessionId"]] = Session(body["sessionId"])
        return Response(status_code=201)

    def session_of(sandbox_id: str, session_id: str) -> Session:
        handle_of(sandbox_id)
        session = server.sandboxes[sandbox_id].sessions.get(session_id)
        if session is None:
            raise HTTPException(404, f"session {session_id} not found")
        return session

    @router.post("/{sandbox_id}/process/session/{session_id}/exec")
    async def session_exec(sandbox_id: str, session_id: str, body: dict[str, Any]) -> Response:
        handle, session = handle_of(sandbox_id), session_of(sandbox_id, session_id)
        command = SessionCommand(uuid.uuid4().hex, body["command"])
        session.commands[command.id] = command

        async def run() -> None:
            result = await provider.exec(handle, command.command, _NO_LIMIT_S)
            command.output = result.output
            command.exit_code = result.exit_code if result.exit_code is not None else -1

        command.job = asyncio.get_running_loop().create_task(run())
        if body.get("runAsync") or body.get("async"):
            return JSONResponse({"cmdId": command.id}, status_code=202)
        await command.job
        return JSONResponse({"cmdId": command.id, "exitCode": command.exit_code,
                             "output": command.output, "stdout": command.output, "stderr": ""})

    @router.get("/{sandbox_id}/process/session/{session_id}")
    async def get_session(sandbox_id: str, session_id: str) -> dict[str, Any]:
        session = session_of(sandbox_id, session_id)
        return {"sessionId": session.id, "commands": [
            {"id": c.id, "command": c.command, "exitCode": c.exit_code}
            for c in session.commands.values()]}

    def command_of(sandbox_id: str, session_id: str, command_id: str) -> SessionCommand:
        command = session_of(sandbox_id, session_id).commands.get(command_id)
        if command is None:
            raise HTTPException(404, f"command {command_id} not found")
        return command

    @router.get("/{sandbox_id}/process/session/{session_id}/command/{command_id}")
    async def get_command(sandbox_id: str, session_id: str, command_id: str) -> dict[str, Any]:
        command = command_of(sandbox_id, session_id, command_id)
        return {"id": command.id, "command": command.command, "exitCode": command.exit_code}

    @router.get("/{sandbox_id}/process/session/{session_id}/command/{command_id}/logs")
    async def command_logs(sandbox_id: str, session_id: str, command_id: str) -> dict[str, Any]:
        command = command_of(sandbox_id, session_id, command_id)
        return {"output": command.output, "stdout": command.output, "stderr": ""}

    @router.delete("/{sandbox_id}/process/session/{session_id}", status_code=204)
    async def delete_session(sandbox_id: str, session_id: str) -> Response:
        session = session_of(sandbox_id, session_id)
        jobs = [c.job for c in session.commands.values() if c.job and not c.job.done()]
        for job in jobs:
            job.cancel()  # cancelling the local exec kills the command's processes
        await asyncio.gather(*jobs, return_exceptions=True)
        server.sandboxes[sandbox_id].sessions.pop(session_id, None)
        return Response(status_code=204)

    @router.post("/{sandbox_id}/files/bulk-upload")
    async def bulk_upload(sandbox_id: str, request: Request) -> Response:
        handle = handle_of(sandbox_id)
        form = await request.form()
        with tempfile.TemporaryDirectory(prefix="daytona-upload-") as tmp:
            for key, value in form.multi_items():
                if not key.endswith(".file") or isinstance(value, str):
                    continue
                dest = str(form.get(key[: -len(".file")] + ".path") or value.filename)
                local = Path(tmp) / _absolute(dest, handle.workdir).lstrip("/")
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_bytes(await value.read())
            await provider.upload(handle, tmp, "/")
        return JSONResponse({"files": [], "errors": []})

    @router.post("/{sandbox_id}/files/bulk-download")
    async def bulk_download(sandbox_id: str, body: dict[str, Any]) -> Response:
        handle = handle_of(sandbox_id)
        boundary = uuid.uuid4().hex
        parts: list[bytes] = []
        for path in body.get("paths", []):
            with tempfile.TemporaryDirectory(prefix="daytona-download-") as tmp:
                local = Path(tmp) / "file"
                try:
                    await provider.download(handle, _absolute(path, handle.workdir), local)
                    name, kind, data = "file", "application/octet-stream", local.read_bytes()
                except FileNotFoundError:
                    name, kind = "error", "application/json"
                    data = json.dumps({"message": f"file not found: {path}",
                                       "statusCode": 404, "code": "FILE_NOT_FOUND"}).encode()
            head = (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
                    f'filename="{path}"\r\nContent-Type: {kind}\r\n\r\n').encode()
            parts.append(head + data + b"\r\n")
        parts.append(f"--{boundary}--\r\n".encode())
        return Response(b"".join(parts),
                        media_type=f"multipart/form-data; boundary={boundary}")

    @router.get("/{sandbox_id}/files/info")
    async def file_info(sandbox_id: str, path: str) -> Response:
        handle = handle_of(sandbox_id)
        target = _absolute(path, handle.workdir)
        result = await provider.exec(handle, 'stat -c "%s|%F|%a|%U|%G|%Y" -- "$0"'
                                     .replace("$0", target.replace('"', '\\"')), 30, cwd="/")
        if result.exit_code != 0:
            return error(404, f"file not found: {path}")
        size, kind, mode, owner, group, mtime = result.stdout.strip().split("|")
        return JSONResponse({"name": Path(target).name, "path": target, "size": int(size),
                             "isDir": kind == "directory", "mode": mode, "permissions": mode,
                             "owner": owner, "group": group, "modTime": mtime})

    @router.post("/{sandbox_id}/files/folder", status_code=201)
    async def create_folder(sandbox_id: str, path: str, mode: str = "755") -> Response:
        handle = handle_of(sandbox_id)
        target = _absolute(path, handle.workdir)
        result = await provider.exec(handle, f"mkdir -p -m {int(mode, 8):o} -- '{target}'", 30,
                                     cwd="/")
        if result.exit_code != 0:
            return error(400, result.output)
        return Response(status_code=201)

    @router.get("/{sandbox_id}/work-dir")
    async def work_dir(sandbox_id: str) -> dict[str, str]:
        return {"dir": handle_of(sandbox_id).workdir}

    @router.get("/{sandbox_id}/user-home-dir")
    async def home_dir(sandbox_id: str) -> dict[str, str]:
        handle_of(sandbox_id)
        return {"dir": "/root"}

    return router
