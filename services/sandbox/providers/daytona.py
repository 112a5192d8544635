"""The Daytona provider: episodes in Daytona sandboxes through the `daytona` SDK's async client.

A sandbox comes from the task's `docker_image` (terminal-bench-2 tasks ship prebuilt images),
else from `image_template` (prebuilt images of bundled tasks), else from the task's Dockerfile
(`Image.from_dockerfile`, context uploaded by the SDK). With `use_snapshots` one snapshot is
built per image and resource shape and reused by every later sandbox. Sandboxes carry labels
(run, instance, incarnation, task, episode, lease; leases.py) that the reaper lists them by
and the service renews leases through (`set_labels`), and auto-stop / auto-delete intervals
as a last resort.
Creates retry with exponential backoff on rate limits (HTTP 429, or "limit"/"rate"/"capacity"
errors). Commands allowed more than `session_command_min_timeout_s` run as session commands
polled until done. Built by `make_provider` for `type = "daytona"`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import shlex
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from daytona import (
    AsyncDaytona,
    CreateSandboxFromImageParams,
    CreateSandboxFromSnapshotParams,
    CreateSnapshotParams,
    DaytonaConfig,
    DaytonaError,
    DaytonaNotFoundError,
    DaytonaRateLimitError,
    FileUpload,
    Image,
    ListSandboxesQuery,
    Resources,
    SessionExecuteRequest,
)
from daytona.common.errors import DaytonaConflictError, DaytonaTimeoutError

from services.common.errors import ConfigError
from services.sandbox.config import DaytonaProviderConfig
from services.sandbox.provider import (
    ExecResult,
    ListedSandbox,
    SandboxError,
    SandboxHandle,
    SandboxProvider,
)
from services.sandbox.task import Task

T = TypeVar("T")
_RATE_WORDS = ("limit", "rate", "capacity", "too many")


def is_rate_limited(exc: BaseException) -> bool:
    """Whether a Daytona error says to slow down rather than that the request is wrong."""
    if isinstance(exc, DaytonaRateLimitError):
        return True
    if not isinstance(exc, DaytonaError) or isinstance(exc, DaytonaNotFoundError):
        return False
    return exc.status_code in (429, 503) or any(w in str(exc).lower() for w in _RATE_WORDS)


def _retry_after_s(exc: BaseException) -> float | None:
    headers = getattr(exc, "headers", None) or {}
    value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


class DaytonaProvider(SandboxProvider):
    """Daytona sandboxes; one AsyncDaytona client per provider, made on first use."""

    name = "daytona"
    supports_listing = True

    def __init__(self, config: DaytonaProviderConfig) -> None:
        self.config = config
        self._api_key = os.environ.get(config.api_key_env, "")
        if not self._api_key:
            raise ConfigError(f"sandbox.provider: Daytona needs an API key in the environment "
                              f"variable {config.api_key_env}")
        self._client: AsyncDaytona | None = None
        self._sandboxes: dict[str, Any] = {}
        self._snapshots: dict[str, asyncio.Future[str]] = {}
        self._counts = {"created": 0, "deleted": 0, "reaped": 0, "rate_limited": 0,
                        "retries": 0,
                        "session_commands": 0, "snapshots_built": 0}

    @property
    def client(self) -> AsyncDaytona:
        if self._client is None:
            self._client = AsyncDaytona(DaytonaConfig(
                api_key=self._api_key, api_url=self.config.api_url, target=self.config.target))
        return self._client

    async def _with_backoff(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        cfg = self.config
        for attempt in range(cfg.num_create_retries + 1):
            try:
                return await call()
            except DaytonaError as exc:
                if not is_rate_limited(exc) or attempt == cfg.num_create_retries:
                    raise SandboxError(f"Daytona {what} failed: {exc}") from exc
                self._counts["rate_limited"] += 1
                self._counts["retries"] += 1
                delay = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2**attempt)
                hinted = _retry_after_s(exc)
                await asyncio.sleep(max(hinted or 0.0, delay * random.uniform(0.5, 1.0)))
        raise AssertionError("unreachable")

    # -- images and snapshots -------------------------------------------------------------

    def _image(self, task: Task) -> str | Image:
        env = task.config.environment
        if env.docker_image:
            return env.docker_image
        if self.config.image_template:
            return self.config.image_template.format(task=task.name)
        return Image.from_dockerfile(task.environment_dir / "Dockerfile")

    def _resources(self, task: Task) -> Resources:
        env = task.config.environment
        return Resources(cpu=max(1, math.ceil(env.cpus)),
                         memory=max(1, math.ceil(env.memory_mb / 1024)),
                         disk=max(1, math.ceil(env.storage_mb / 1024)),
                         gpu=env.gpus or None)

    def _snapshot_name(self, image: str | Image, resources: Resources) -> str:
        text = image if isinstance(image, str) else image.dockerfile()
        key = f"{text}|{resources.cpu}|{resources.memory}|{resources.disk}|{resources.gpu}"
        if not isinstance(image, str):
            for context in image._context_list:  # build context changes the image too
                key += _tree_digest(Path(context.source_path))
        return f"{self.config.snapshot_prefix}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"

    async def _snapshot_for(self, task: Task, image: str | Image, resources: Resources) -> str:
        """The snapshot of this image, built once per provider and shared by concurrent
        creates; a failed build is forgotten so that the next create tries again."""
        name = self._snapshot_name(image, resources)
        pending = self._snapshots.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._ensure_snapshot(task, name, image, resources))
            self._snapshots[name] = pending
            pending.add_done_callback(
                lambda f: self._snapshots.pop(name, None)
                if f.cancelled() or f.exception() else None)
        return await asyncio.shield(pending)

    async def _ensure_snapshot(self, task: Task, name: str, image: str | Image,
                               resources: Resources) -> str:
        try:
            await self._with_backoff("snapshot lookup", lambda: self.client.snapshot.get(name))
            return name  # built earlier (by this run or a previous one)
        except SandboxError as exc:
            if not isinstance(exc.__cause__, DaytonaNotFoundError):
                raise
        params = CreateSnapshotParams(name=name, image=image, resources=resources)
        timeout_s = max(task.config.environment.build_timeout_sec, 60.0)
        try:
            await self._with_backoff("snapshot build", lambda: self.client.snapshot.create(
                params, timeout=timeout_s))
            self._counts["snapshots_built"] += 1
        except SandboxError as exc:
            if not isinstance(exc.__cause__, DaytonaConflictError):
                raise
        return name

    # -- lifecycle ------------------------------------------------------------------------

    async def create(self, task: Task, labels: Mapping[str, str] | None = None) -> SandboxHandle:
        cfg = self.config
        image, resources = self._image(task), self._resources(task)
        common: dict[str, Any] = {
            "labels": dict(labels or {}), "auto_stop_interval": cfg.auto_stop_interval_min,
            "auto_delete_interval": cfg.auto_delete_interval_min,
            "network_block_all": not task.config.environment.allow_internet,
        }
        params: CreateSandboxFromSnapshotParams | CreateSandboxFromImageParams
        if cfg.use_snapshots:
            snapshot = await self._snapshot_for(task, image, resources)
            params = CreateSandboxFromSnapshotParams(snapshot=snapshot, **common)
        else:
            params = CreateSandboxFromImageParams(image=image, resources=resources, **common)
        sandbox = await self._with_backoff("create", lambda: self._create(params))
        self._sandboxes[sandbox.id] = sandbox
        self._counts["created"] += 1
        return SandboxHandle(sandbox_id=sandbox.id, task_name=task.name, provider=self.name,
                             workdir=task.workdir, created_at=time.time(),
                             info={"snapshot": getattr(params, "snapshot", None)})

    async def _create(self, params: Any) -> Any:
        try:
            return await self.client.create(params, timeout=self.config.create_timeout_s)
        except DaytonaTimeoutError as exc:
            if exc.sandbox_id:  # created, but not started in time: do not leave it behind
                await self._delete_by_id(exc.sandbox_id)
            raise

    async def _delete_by_id(self, sandbox_id: str) -> None:
        try:
            sandbox = await self.client.get(sandbox_id)
            await sandbox.delete(timeout=self.config.request_timeout_s)
        except DaytonaNotFoundError:
            pass

    async def delete(self, handle: SandboxHandle) -> None:
        sandbox = self._sandboxes.pop(handle.sandbox_id, None)
        if sandbox is None:
            return
        try:
            await self._with_backoff("delete", lambda: sandbox.delete(
                timeout=self.config.request_timeout_s))
        except SandboxError as exc:
            if not isinstance(exc.__cause__, DaytonaNotFoundError):
                raise
        self._counts["deleted"] += 1

    # -- leases and the reaper ---------------------------------------------------------

    async def list_sandboxes(self, labels: Mapping[str, str]) -> list[ListedSandbox]:
        query = ListSandboxesQuery(labels=dict(labels))
        try:
            return [ListedSandbox(sandbox.id, dict(sandbox.labels or {}), {"sandbox": sandbox})
                    async for sandbox in self.client.list(
                        query, request_timeout=self.config.request_timeout_s)]
        except DaytonaError as exc:
            raise SandboxError(f"Daytona list failed: {exc}") from exc

    async def set_labels(self, handle: SandboxHandle, labels: Mapping[str, str]) -> None:
        sandbox = self._get(handle)
        merged = {**(sandbox.labels or {}), **labels}  # keeps the SDK's own labels
        await self._with_backoff("label update", lambda: sandbox.set_labels(
            merged, request_timeout=self.config.request_timeout_s))

    async def delete_listed(self, sandbox: ListedSandbox) -> None:
        if sandbox.sandbox_id in self._sandboxes:
            await self.delete(SandboxHandle(sandbox.sandbox_id, "", self.name))
            return
        found = sandbox.info.get("sandbox")
        try:
            if found is None:
                await self._with_backoff("reaper delete",
                                         lambda: self._delete_by_id(sandbox.sandbox_id))
            else:
                await self._with_backoff("reaper delete", lambda: found.delete(
                    timeout=self.config.request_timeout_s))
        except SandboxError as exc:
            if not isinstance(exc.__cause__, DaytonaNotFoundError):
                raise
        self._counts["reaped"] += 1

    async def close(self) -> None:
        await asyncio.gather(*(self.delete(SandboxHandle(sid, "", self.name))
                               for sid in list(self._sandboxes)), return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None

    def stats(self) -> dict[str, Any]:
        return {"sandboxes_alive": len(self._sandboxes), "snapshots_cached": len(self._snapshots),
                **self._counts}

    def _get(self, handle: SandboxHandle) -> Any:
        sandbox = self._sandboxes.get(handle.sandbox_id)
        if sandbox is None:
            raise SandboxError(f"Daytona sandbox {handle.sandbox_id} is not live (deleted?)")
        return sandbox

    # -- commands and files ---------------------------------------------------------------

    async def exec(self, handle: SandboxHandle, command: str, timeout_s: float,
                   cwd: str | None = None, env: Mapping[str, str] | None = None) -> ExecResult:
        sandbox = self._get(handle)
        cwd = cwd or handle.workdir
        started = time.monotonic()
        if timeout_s > self.config.session_command_min_timeout_s:
            return await self._exec_session(sandbox, command, timeout_s, cwd, env, started)
        wrapped = f"bash -lc {shlex.quote(command)}"
        try:
            response = await sandbox.process.exec(wrapped, cwd=cwd, env=dict(env or {}) or None,
                                                  timeout=max(1, math.ceil(timeout_s)))
        except DaytonaTimeoutError:
            return ExecResult(None, "", timed_out=True, duration_s=time.monotonic() - started)
        except DaytonaError as exc:
            raise SandboxError(f"Daytona exec in {handle.sandbox_id} failed: {exc}") from exc
        return ExecResult(response.exit_code, response.result or "",
                          duration_s=time.monotonic() - started)

    async def _exec_session(self, sandbox: Any, command: str, timeout_s: float, cwd: str,
                            env: Mapping[str, str] | None, started: float) -> ExecResult:
        """A long command: started asynchronously in its own session, polled until it exits;
        at the timeout the session is deleted, which kills the command's processes."""
        self._counts["session_commands"] += 1
        session_id = f"riptide-{uuid.uuid4().hex[:12]}"
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        line = f"cd {shlex.quote(cwd)} && {'env ' + exports + ' ' if exports else ''}" \
               f"bash -lc {shlex.quote(command)} 2>&1"
        process = sandbox.process
        try:
            await process.create_session(session_id)
            try:
                submitted = await process.execute_session_command(
                    session_id, SessionExecuteRequest(command=line, run_async=True))
                exit_code = await self._poll(process, session_id, submitted.cmd_id,
                                             started + timeout_s)
                logs = await process.get_session_command_logs(session_id, submitted.cmd_id)
            finally:
                await process.delete_session(session_id)
        except DaytonaError as exc:
            raise SandboxError(f"Daytona session command failed: {exc}") from exc
        output = logs.output or (logs.stdout or "") + (logs.stderr or "")
        return ExecResult(exit_code, output, timed_out=exit_code is None,
                          duration_s=time.monotonic() - started)

    async def _poll(self, process: Any, session_id: str, cmd_id: str,
                    deadline: float) -> int | None:
        while True:
            command = await process.get_session_command(session_id, cmd_id)
            if command.exit_code is not None:
                return int(command.exit_code)
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(min(self.config.session_poll_interval_s,
                                    max(0.0, deadline - time.monotonic())))

    async def upload(self, handle: SandboxHandle, local_path: Path | str, remote_path: str) -> None:
        sandbox = self._get(handle)
        local, remote = Path(local_path), "/" + remote_path.strip("/")
        if not local.exists():
            raise FileNotFoundError(f"{local}: no such file or directory to upload")
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        uploads = [FileUpload(source=str(p), destination=(
            f"{remote}/{p.relative_to(local).as_posix()}" if local.is_dir() else remote))
            for p in files]
        try:
            if local.is_dir():
                await sandbox.fs.create_folder(remote, "755")
            if uploads:
                await sandbox.fs.upload_files(uploads)
        except DaytonaError as exc:
            raise SandboxError(f"Daytona upload to {remote} failed: {exc}") from exc
        executable = [u.destination for u, p in zip(uploads, files, strict=True)
                      if os.access(p, os.X_OK)]
        if executable:  # uploads do not carry file modes
            await self.exec(handle, "chmod +x " + " ".join(map(shlex.quote, executable)), 30, "/")

    async def download(self, handle: SandboxHandle, remote_path: str,
                       local_path: Path | str) -> None:
        sandbox = self._get(handle)
        local = Path(local_path)
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            info = await sandbox.fs.get_file_info(remote_path)
            if not info.is_dir:
                local.write_bytes(await sandbox.fs.download_file(remote_path))
                return
            archive = f"/tmp/riptide-download-{uuid.uuid4().hex[:8]}.tar"
            packed = await self.exec(handle, f"tar -cf {archive} -C {shlex.quote(remote_path)} .",
                                     120, "/")
            if packed.exit_code != 0:
                raise SandboxError(f"packing {remote_path} failed: {packed.output[-500:]}")
            data = await sandbox.fs.download_file(archive)
        except DaytonaNotFoundError:
            raise FileNotFoundError(f"{remote_path}: not found in {handle.sandbox_id}") from None
        except DaytonaError as exc:
            raise SandboxError(f"Daytona download of {remote_path} failed: {exc}") from exc
        await asyncio.to_thread(_untar, data, local)


def _untar(data: bytes, local: Path) -> None:
    import io
    import tarfile

    local.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(local, filter="data")


def _tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for item in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if item.is_file():
            digest.update(item.as_posix().encode())
            digest.update(item.read_bytes())
    return digest.hexdigest()
