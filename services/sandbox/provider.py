"""The sandbox provider interface: create a sandbox from a task, run commands, move files, delete.

Two implementations sit behind it, chosen by the `type` field of the provider config:
`local` (bubblewrap on this machine, providers/local.py) and `daytona` (providers/daytona.py).
The agent and the verifier speak only to this interface.

Paths given to `exec`, `upload` and `download` are paths *inside* the sandbox, as the task
sees them (`/app`, `/tests`, `/logs/verifier`, `/solution`); each provider maps them onto its
own storage. A command's failure is an `ExecResult` with its exit code; a failure of the
sandbox itself (cannot start, vanished, provider down) raises `SandboxError`.

Three optional hooks serve leases and the reaper (leases.py, reaper.py): `list_sandboxes`
finds sandboxes by label at the provider, whichever process made them; `set_labels`
replaces a live sandbox's labels (a lease renewal); `delete_listed` deletes a listed one.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from services.common.errors import ConfigError, Unavailable

if TYPE_CHECKING:
    from services.sandbox.task import Task


class SandboxError(Unavailable):
    """The sandbox or its provider failed (not the command in it): the episode has no verdict."""


@dataclass(frozen=True)
class SandboxHandle:
    """A live sandbox. Opaque to callers beyond these fields; providers keep their own state."""

    sandbox_id: str
    task_name: str
    provider: str
    workdir: str = "/app"
    """The default working directory of commands (the image's WORKDIR)."""
    created_at: float = 0.0
    info: Mapping[str, Any] = field(default_factory=dict)
    """Provider-specific details (Daytona sandbox id, local tree path) for logs and debugging."""


@dataclass(frozen=True)
class ExecResult:
    """What one command did. Providers may merge stderr into stdout (local and Daytona do)."""

    exit_code: int | None
    """The command's exit status; None when it was killed at its timeout."""
    stdout: str
    stderr: str = ""
    timed_out: bool = False
    duration_s: float = 0.0
    output_truncated: bool = False
    """True when the output exceeded the provider's cap and only its head and tail were kept."""

    @property
    def output(self) -> str:
        """Everything the command printed, as a terminal would show it."""
        if not self.stderr:
            return self.stdout
        return self.stdout + self.stderr


@dataclass(frozen=True)
class ListedSandbox:
    """A sandbox as the provider lists it: any process's, found by its labels."""

    sandbox_id: str
    labels: Mapping[str, str]
    info: Mapping[str, Any] = field(default_factory=dict)
    """What the provider needs to delete it (a local tree's path)."""


class SandboxProvider(abc.ABC):
    """One kind of sandbox; implementations are safe to call concurrently from one event loop."""

    name: str = "abstract"

    @abc.abstractmethod
    async def create(self, task: Task, labels: Mapping[str, str] | None = None) -> SandboxHandle:
        """Start a sandbox holding the task's environment (`/app` ...), without `tests/` or
        `solution/`. Honors the task's resource caps (cpus, memory, storage, internet).
        `labels` (run, task, episode) tag the sandbox where the provider supports tags."""

    @abc.abstractmethod
    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        timeout_s: float,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run `command` with `bash -lc` in the sandbox (cwd defaults to `handle.workdir`).
        At `timeout_s` the command and every process it started are killed
        (`timed_out=True`, `exit_code=None`)."""

    @abc.abstractmethod
    async def upload(self, handle: SandboxHandle, local_path: Path | str, remote_path: str) -> None:
        """Copy a local file or directory to `remote_path` (a directory's contents land in
        `remote_path`, which is created with its parents)."""

    @abc.abstractmethod
    async def download(
        self, handle: SandboxHandle, remote_path: str, local_path: Path | str
    ) -> None:
        """Copy a sandbox file or directory to `local_path` (replacing it); raises
        `FileNotFoundError` when `remote_path` does not exist in the sandbox."""

    @abc.abstractmethod
    async def delete(self, handle: SandboxHandle) -> None:
        """Kill everything running in the sandbox and release it. Idempotent."""

    supports_listing: bool = False
    """Whether `list_sandboxes` sees every sandbox at the provider (leases need it)."""

    async def list_sandboxes(self, labels: Mapping[str, str]) -> list[ListedSandbox]:
        """Sandboxes at the provider carrying every label in `labels`, made by any process.
        Optional: none by default (`supports_listing` False)."""
        return []

    async def set_labels(self, handle: SandboxHandle,  # noqa: B027 (an optional hook)
                         labels: Mapping[str, str]) -> None:
        """Replace the labels of a live sandbox (a lease renewal). Optional."""

    async def delete_listed(self, sandbox: ListedSandbox) -> None:  # noqa: B027
        """Delete a sandbox found by `list_sandboxes`, whoever made it. Idempotent. Optional."""

    async def close(self) -> None:  # noqa: B027 (an optional hook)
        """Release provider-wide resources (clients, pools). Optional."""

    def stats(self) -> dict[str, Any]:
        """Live figures for the admin API (sandboxes alive, ...). Optional."""
        return {}


class ProviderConfig(Protocol):
    """What `make_provider` needs: a `type` field naming the implementation."""

    type: str


def make_provider(config: ProviderConfig) -> SandboxProvider:
    """Build the provider named by `config.type` (`local` or `daytona`)."""
    if config.type == "local":
        from services.sandbox.providers.local import LocalProvider

        return LocalProvider(config)  # type: ignore[arg-type]
    if config.type == "daytona":
        from services.sandbox.providers.daytona import DaytonaProvider

        return DaytonaProvider(config)  # type: ignore[arg-type]
    raise ConfigError(f"unknown sandbox provider type {config.type!r}; use 'local' or 'daytona'")
