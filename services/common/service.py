"""The contract between a service and the shared bootstrap (services/common/serve.py).

A service subclasses ServiceRuntime, registers its gRPC servicers in `add_to_grpc`, and
overrides only the hooks it needs; every hook has a sensible default.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from services.common.errors import ConfigError, Conflict, quote
from services.common.grpc_server import GuardedRegistrar

log = logging.getLogger(__name__)


class ServiceRuntime:
    """One service's behaviour, plugged into the gRPC server and the admin REST app."""

    name: str = "service"
    #: The config model whose fields `PATCH /admin/config` may change at run time.
    tunable: BaseModel | None = None
    #: Field names of `tunable` that may be patched live (empty: none).
    tunable_fields: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.paused = False
        self.started_monotonic = time.monotonic()
        #: Set by `request_exit`: the process ends with this code (serve.py returns it).
        self.exit_code: int | None = None
        self._on_exit: Callable[[], None] = lambda: None

    def request_exit(self, code: int, reason: str) -> None:
        """End the process with `code`, from any thread: 0 when one-shot work is done,
        non-zero when the service cannot go on and its supervisor should restart it."""
        log.log(logging.INFO if code == 0 else logging.ERROR, "exiting with code %d: %s",
                code, reason)
        self.exit_code = code
        self._on_exit()

    def bind_exit(self, on_exit: Callable[[], None]) -> None:
        """serve.py's hook that `request_exit` calls (thread-safe on its side)."""
        self._on_exit = on_exit
        if self.exit_code is not None:
            on_exit()

    def lifecycle(self) -> str:
        """starting, ready or paused."""
        if self.paused:
            return "paused"
        return "ready" if self.ready() else "starting"

    def status(self) -> dict[str, Any]:
        """What /admin/state and the GetStatus RPC report."""
        return {
            "service": self.name,
            "state": self.lifecycle(),
            "uptime_s": round(time.monotonic() - self.started_monotonic, 3),
            "details": self.state(),
        }

    def add_to_grpc(self, server: GuardedRegistrar) -> None:
        """Register this service's gRPC servicers."""

    async def start(self) -> None:
        """Acquire resources and start background work; readiness follows `ready()`."""

    async def stop(self) -> None:
        """Stop background work and release resources (after gRPC stopped accepting)."""

    def ready(self) -> bool:
        """Whether the service can do its work now (drives /readyz and gRPC health)."""
        return True

    def state(self) -> dict[str, Any]:
        """Live state for /admin/state and GetStatus (JSON-serialisable)."""
        return {}

    async def pause(self) -> None:
        """Stop taking new work (POST /admin/pause)."""
        if self.paused:
            raise Conflict(f"{self.name} is already paused")
        self.paused = True

    async def resume(self) -> None:
        """Take new work again (POST /admin/resume)."""
        if not self.paused:
            raise Conflict(f"{self.name} is not paused")
        self.paused = False

    def apply_config_patch(self, patch: dict[str, Any]) -> dict[str, Any]:
        """Change tunable settings live; all-or-nothing. Returns the tunable settings after."""
        if self.tunable is None or not self.tunable_fields:
            raise ConfigError(f"{self.name} has no live-tunable settings")
        unknown = sorted(set(patch) - self.tunable_fields)
        if unknown:
            raise ConfigError(
                f"not tunable live: {', '.join(quote(k, 40) for k in unknown[:5])}; "
                f"tunable: {', '.join(sorted(self.tunable_fields))}"
            )
        from pydantic import ValidationError

        from services.common.config import format_validation_error

        merged = {**self.tunable.model_dump(), **patch}
        try:  # strict: "8" or true is not the number 8 or 1 in a live patch
            candidate = type(self.tunable).model_validate(merged, strict=True)
        except ValidationError as exc:
            raise ConfigError(format_validation_error("patch", exc)) from None
        for key in patch:
            setattr(self.tunable, key, getattr(candidate, key))
        self.on_config_changed(sorted(patch))
        return {key: getattr(self.tunable, key) for key in sorted(self.tunable_fields)}

    def on_config_changed(self, keys: list[str]) -> None:
        """Called after a successful live patch with the changed keys."""

    def admin_routes(self) -> APIRouter | None:
        """Extra routes mounted under /admin/ (behind the token)."""
        return None

    def page_routes(self) -> APIRouter | None:
        """Extra routes mounted at the root, for pages such as /dashboard: the guard asks
        for the token on their /<page>/api/ paths (admin_guard.GUARDED_PREFIXES) only."""
        return None



def status_message(runtime: ServiceRuntime) -> Any:
    """The ServiceStatus protobuf of a runtime, for its GetStatus RPC."""
    import json

    from google.protobuf import json_format, struct_pb2

    from services._proto.riptide.v1 import common_pb2

    status = runtime.status()
    details = struct_pb2.Struct()
    json_format.ParseDict(json.loads(json.dumps(status["details"], default=str)), details)
    return common_pb2.ServiceStatus(service=status["service"], state=status["state"],
                                    uptime_s=status["uptime_s"], details=details)
