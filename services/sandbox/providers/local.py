"""The local provider: one bubblewrap sandbox per episode on this machine.

Each sandbox is a directory tree (providers/local_tree.py) that every command sees as `/`,
run by a fresh `bwrap` per command (providers/bwrap.py) with no network, no view of host
files outside the tree, and rlimits; as root each sandbox also gets a host uid of its own
(providers/local_uids.py). Where the host allows, a sandbox's total memory and processes are
capped by a cgroup of its own (providers/local_cgroups.py) and its tree is a tmpfs of the
task's storage size; where not, a warning says so and only the per-process rlimits hold.
A sandbox's labels (leases.py) are kept in `labels.json` beside its tree, outside what the
sandbox sees, so the reaper of a later process lists and deletes them; a crashed process's
unlabelled trees go when the next provider starts. Built by `make_provider` for
`type = "local"`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from services.common.config import StrictModel
from services.sandbox.provider import (
    ExecResult,
    ListedSandbox,
    SandboxError,
    SandboxHandle,
    SandboxProvider,
)
from services.sandbox.providers import local_tree
from services.sandbox.providers.bwrap import Limits, SandboxRun, bwrap_argv, limit_argv
from services.sandbox.providers.local_cgroups import CgroupHost, SandboxCgroup
from services.sandbox.providers.local_uids import UidPool, kill_uid, threads_of_uid
from services.sandbox.task import Task

log = logging.getLogger(__name__)
#: pids of a command that are bubblewrap's own (its parent and pid 1), beyond the task's.
_BWRAP_PROCESSES = 4
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_TRANSFER_TIMEOUT_S = 120.0


class LocalProviderConfig(StrictModel):
    """Settings of local (bubblewrap) sandboxes."""

    type: Literal["local"] = Field("local", description="provider kind")
    root_dir: Path | None = Field(
        None, description="where sandbox trees live (default: /dev/shm if a tmpfs, else tmp)"
    )
    bwrap_path: str = Field(
        "bwrap", description="the bubblewrap binary: a path, or a name looked up on PATH")
    max_processes: int = Field(256, ge=8, description="processes+threads per sandbox (NPROC)")
    max_memory_mb: int = Field(4096, ge=64, description="cap on a task's memory: all its "
                               "processes together (cgroup) and each one's RLIMIT_AS")
    max_storage_mb: int = Field(10240, ge=1, description="cap on a task's storage: its tree's "
                                "tmpfs size (as root) and the largest file (FSIZE)")
    use_cgroups: bool = Field(True, description="cap each sandbox's memory and processes with "
                              "a cgroup (v2, or v1 memory+pids) when the host allows")
    cgroup_parent: str = Field("riptide-sandboxes", pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$",
                               description="cgroup (relative to each hierarchy's root) that "
                               "holds the sandboxes' cgroups")
    tmpfs_per_sandbox: bool = Field(True, description="give each sandbox tree a tmpfs of the "
                                    "task's storage size when the provider may mount (root)")
    max_output_kb: int = Field(1024, ge=1, description="output kept per command (head+tail)")
    pin_cpus: bool = Field(True, description="pin each sandbox to the task's number of CPUs")
    uid_base: int = Field(620000, ge=1000, description="first host uid of sandboxes (as root)")
    num_uids: int = Field(4096, ge=1, description="host uids reserved for sandboxes (as root)")
    fail_create_while: Path | None = Field(
        None, description="fault injection (the fault suite, bench/soak.py): while this file "
        "exists every sandbox creation fails, as on an unhealthy host (None: off)")


@dataclass
class _Sandbox:
    handle: SandboxHandle
    root: Path
    uid: int | None
    limits: Limits
    env: dict[str, str]
    cgroup: SandboxCgroup | None = None
    runs: set[SandboxRun] = field(default_factory=set)
    deleted: bool = False

    @property
    def fs(self) -> Path:
        return self.root / "fs"


class LocalProvider(SandboxProvider):
    """Bubblewrap sandboxes on this machine."""

    name = "local"
    supports_listing = True

    def __init__(self, config: LocalProviderConfig) -> None:
        found = (config.bwrap_path if "/" in config.bwrap_path
                 else shutil.which(config.bwrap_path))
        if found is None or not os.access(found, os.X_OK):
            where = f"at {config.bwrap_path}" if "/" in config.bwrap_path else (
                f"on PATH ({config.bwrap_path!r})")
            raise SandboxError(f"bubblewrap not found {where}; install bubblewrap (Debian/"
                               "Ubuntu: apt-get install bubblewrap) or set the local "
                               "provider's bwrap_path")
        self.config = config.model_copy(update={"bwrap_path": found})
        base = config.root_dir or _default_root()
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o711)
        _remove_dead_instances(base)
        # On tmpfs a tree takes ~2 ms to build: cheaper inline than through a worker thread.
        self._inline_fs_ops = _on_tmpfs(base)
        self._dir = base / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._dir.mkdir(mode=0o711)
        self._ro_binds = local_tree.host_system_binds()
        self._skeleton = self._dir / "skeleton"
        local_tree.build_skeleton(self._skeleton, self._ro_binds)
        self._uids = UidPool(config.uid_base, config.num_uids) if os.geteuid() == 0 else None
        self._sandboxes: dict[str, _Sandbox] = {}
        self._foreign_lock = threading.Lock()
        self._plans: dict[Path, Any] = {}
        self._cpu_ids = sorted(os.sched_getaffinity(0))
        self._next_cpu = 0
        self._create_ms: list[float] = []
        self._cgroups: CgroupHost | None = None
        self._tmpfs = False
        try:
            self._probe()
            self._detect_caps()
        except BaseException:
            local_tree.remove_tree(self._dir)
            raise

    def _detect_caps(self) -> None:
        """Choose the sandbox-wide caps this host allows, and say what falls back."""
        if self.config.use_cgroups:
            self._cgroups, note = CgroupHost.detect(self.config.cgroup_parent, self._dir.name)
            if self._cgroups is None:
                log.warning("local sandboxes: no writable cgroup hierarchy (%s); memory and "
                            "processes are capped per process only (rlimits)", note)
            else:
                self._cgroups.remove_dead_instances()
                log.info("local sandboxes: memory and processes capped per sandbox by %s", note)
        if self.config.tmpfs_per_sandbox:
            probe = self._dir / "tmpfs-probe"
            probe.mkdir()
            try:
                local_tree.mount_tmpfs(probe, 1)
                local_tree.unmount(probe)
                self._tmpfs = True
            except OSError as exc:
                log.warning("local sandboxes: cannot mount a tmpfs per sandbox (%s); storage "
                            "is capped per file only (RLIMIT_FSIZE)", exc.strerror)
            finally:
                probe.rmdir()

    @property
    def caps(self) -> dict[str, str]:
        """How memory, processes and storage are capped here."""
        group = f"cgroup {self._cgroups.kind}" if self._cgroups else "rlimits per process"
        return {"memory": group, "processes": group,
                "storage": "tmpfs per sandbox" if self._tmpfs else "RLIMIT_FSIZE per file"}

    def _probe(self) -> None:
        """Fail loudly now if this machine cannot make user namespaces: never run unsandboxed."""
        uid = self._uids.lease() if self._uids else None
        root = self._dir / "probe"
        try:
            local_tree.populate(root, self._skeleton, [], [])
            if uid is not None:
                local_tree.chown_tree(root, uid)
            argv = bwrap_argv(self.config.bwrap_path, root, self._ro_binds, {"PATH": _PATH},
                              "/", ["true"])(2)
            argv[argv.index("--json-status-fd") : argv.index("--json-status-fd") + 2] = []
            result = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                                    user=uid, group=uid, extra_groups=[] if uid else None)
        finally:
            local_tree.remove_tree(root)
            if uid is not None and self._uids:
                self._uids.release(uid)
        if result.returncode != 0:
            raise SandboxError(
                "local sandboxes need unprivileged user namespaces and bubblewrap, which failed "
                f"here: {result.stderr.strip()!r}. Check sysctls kernel.unprivileged_userns_clone,"
                " user.max_user_namespaces and kernel.apparmor_restrict_unprivileged_userns; "
                "there is no unsandboxed fallback."
            )

    def _limits(self, task: Task) -> Limits:
        env = task.config.environment
        cpus = max(1, math.ceil(env.cpus))
        cpu_list = None
        if self.config.pin_cpus and cpus < len(self._cpu_ids):
            start = self._next_cpu
            self._next_cpu = (start + cpus) % len(self._cpu_ids)
            cpu_list = tuple(self._cpu_ids[(start + i) % len(self._cpu_ids)] for i in range(cpus))
        return Limits(
            memory_mb=min(env.memory_mb, self.config.max_memory_mb),
            max_processes=self.config.max_processes,
            file_size_mb=min(env.storage_mb, self.config.max_storage_mb),
            cpu_list=cpu_list,
        )

    async def create(self, task: Task,
                     labels: Mapping[str, str] | None = None) -> SandboxHandle:
        start = time.monotonic()
        injected = self.config.fail_create_while
        if injected is not None and injected.exists():
            raise SandboxError(f"sandbox creation failed: injected fault ({injected} exists)")
        plan = self._plans.get(task.path)
        if plan is None:
            plan = self._plans[task.path] = local_tree.copy_plan(task, self._ro_binds)
        sandbox_id = f"sbx-{uuid.uuid4().hex[:12]}"
        root = self._dir / sandbox_id
        uid = self._uids.lease() if self._uids else None
        limits = self._limits(task)
        cgroup = None
        try:
            await self._fs_op(self._make_tree, root, plan, uid, limits.file_size_mb)
            if self._cgroups is not None:
                cgroup = self._cgroups.create(sandbox_id, limits.memory_mb,
                                              limits.max_processes + _BWRAP_PROCESSES)
        except BaseException:
            await self._fs_op(local_tree.remove_tree, root)
            if uid is not None and self._uids:
                self._uids.release(uid)
            raise
        env = {"PATH": _PATH, "HOME": "/root", "USER": "root", "LANG": "C.UTF-8",
               "TERM": "dumb", "SHELL": "/bin/bash", "HOSTNAME": "sandbox"}
        env.update(task.dockerfile.env if task.dockerfile else {})
        env["RIPTIDE_SANDBOX_ID"] = sandbox_id
        handle = SandboxHandle(
            sandbox_id=sandbox_id, task_name=task.name, provider=self.name,
            workdir=task.workdir, created_at=time.time(),
            info={"root": str(root / "fs"), "uid": uid, "labels": dict(labels or {})},
        )
        if labels:
            await self._fs_op(_write_labels, root, dict(labels))
        self._sandboxes[sandbox_id] = _Sandbox(handle, root, uid, limits, env, cgroup)
        self._create_ms.append((time.monotonic() - start) * 1000)
        del self._create_ms[:-1000]
        return handle

    async def _fs_op(self, func: Any, *args: Any) -> Any:
        if self._inline_fs_ops:
            return func(*args)
        return await asyncio.to_thread(func, *args)

    def _make_tree(self, root: Path, plan: Any, uid: int | None, storage_mb: int) -> None:
        root.mkdir(mode=0o700)
        if self._tmpfs:
            local_tree.mount_tmpfs(root, storage_mb)
        local_tree.populate(root / "fs", self._skeleton, *plan)
        if uid is not None:
            local_tree.chown_tree(root, uid)

    def _get(self, handle: SandboxHandle) -> _Sandbox:
        sandbox = self._sandboxes.get(handle.sandbox_id)
        if sandbox is None or sandbox.deleted:
            raise SandboxError(f"sandbox {handle.sandbox_id} does not exist (deleted?)")
        return sandbox

    async def _run(
        self, sandbox: _Sandbox, argv: list[str], timeout_s: float, cwd: str,
        env: Mapping[str, str] | None = None, stdin: bytes | None = None,
        merge_stderr: bool = True, max_output_bytes: int | None = None,
    ) -> tuple[SandboxRun, Any]:
        for mount in self._ro_binds:  # a mount point swapped for a symlink would redirect binds
            target = sandbox.fs / mount.lstrip("/")
            if target.is_symlink() or not target.is_dir():
                raise SandboxError(f"sandbox {sandbox.handle.sandbox_id}: {mount} was tampered")
        full_env = {**sandbox.env, **(env or {})}
        inner = bwrap_argv(self.config.bwrap_path, sandbox.fs, self._ro_binds, full_env, cwd,
                           argv)
        limits = sandbox.limits
        if sandbox.uid is None:  # sharing the user's uid: NPROC counts all of its threads too
            limits = dataclasses.replace(
                limits, max_processes=limits.max_processes + threads_of_uid(os.getuid())
            )
        prefix = limit_argv(limits, cpu_time_s=timeout_s + 1)
        cap = max_output_bytes or self.config.max_output_kb * 1024
        enter = sandbox.cgroup.enter_argv() if sandbox.cgroup else ()
        run = SandboxRun(lambda fd: [*prefix, *inner(fd)], sandbox.uid, cap, enter)
        sandbox.runs.add(run)
        try:
            outcome = await run.run(timeout_s, stdin=stdin, merge_stderr=merge_stderr)
        finally:
            sandbox.runs.discard(run)
        if sandbox.deleted:
            raise SandboxError(f"sandbox {sandbox.handle.sandbox_id} was deleted during a command")
        if not run.started and not outcome.timed_out:
            raise SandboxError(
                f"bubblewrap failed to start sandbox {sandbox.handle.sandbox_id}: "
                f"{(outcome.stdout + outcome.stderr).decode(errors='replace').strip()[-2000:]}"
            )
        return run, outcome

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        timeout_s: float,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        sandbox = self._get(handle)
        _, out = await self._run(sandbox, ["bash", "-lc", command], timeout_s,
                                 cwd or handle.workdir, env)
        return ExecResult(
            exit_code=out.exit_code, stdout=out.stdout.decode(errors="replace"),
            timed_out=out.timed_out, duration_s=out.duration_s, output_truncated=out.truncated,
        )

    async def upload(self, handle: SandboxHandle, local_path: Path | str, remote_path: str) -> None:
        sandbox = self._get(handle)
        local = Path(local_path)
        if not local.exists():
            raise FileNotFoundError(f"{local}: no such file or directory to upload")
        remote = "/" + remote_path.strip("/")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            if local.is_dir():
                for child in sorted(local.iterdir()):
                    tar.add(child, arcname=child.name)
                target_dir = remote
            else:
                tar.add(local, arcname=os.path.basename(remote))
                target_dir = os.path.dirname(remote) or "/"
        script = 'mkdir -p -- "$1" && exec tar -x --no-same-owner -f - -C "$1"'
        _, out = await self._run(sandbox, ["bash", "-c", script, "upload", target_dir],
                                 _TRANSFER_TIMEOUT_S, "/", stdin=buf.getvalue())
        if out.exit_code != 0:
            raise SandboxError(f"upload to {remote} failed: {out.stdout.decode(errors='replace')}")

    async def download(
        self, handle: SandboxHandle, remote_path: str, local_path: Path | str
    ) -> None:
        sandbox = self._get(handle)
        remote = "/" + remote_path.strip("/")
        parent, name = os.path.dirname(remote) or "/", os.path.basename(remote) or "."
        script = (
            'cd -- "$1" 2>/dev/null && { test -e "$2" || test -L "$2"; } || exit 44; '
            'exec tar -cf - -- "$2"'
        )
        _, out = await self._run(
            sandbox, ["bash", "-c", script, "download", parent, name], _TRANSFER_TIMEOUT_S, "/",
            merge_stderr=False, max_output_bytes=1 << 40,
        )
        if out.exit_code == 44:
            raise FileNotFoundError(f"{remote}: not found in sandbox {handle.sandbox_id}")
        if out.exit_code != 0:
            reason = out.stderr.decode(errors="replace")
            raise SandboxError(f"download of {remote} failed: {reason}")
        try:
            await asyncio.to_thread(_extract_single, out.stdout, name, Path(local_path))
        except tarfile.TarError as exc:  # e.g. a link pointing out of what was downloaded
            raise SandboxError(f"download of {remote} refused: {exc}") from None

    async def delete(self, handle: SandboxHandle) -> None:
        sandbox = self._sandboxes.get(handle.sandbox_id)
        if sandbox is None or sandbox.deleted:
            return
        sandbox.deleted = True
        try:
            await asyncio.gather(*(run.kill() for run in list(sandbox.runs)))
            if sandbox.cgroup is not None:
                await asyncio.to_thread(sandbox.cgroup.remove)
            if sandbox.uid is not None:
                await asyncio.to_thread(kill_uid, sandbox.uid)
            await self._fs_op(local_tree.remove_tree, sandbox.root)
        finally:
            if sandbox.uid is not None and self._uids:
                self._uids.release(sandbox.uid)
            del self._sandboxes[handle.sandbox_id]

    async def list_sandboxes(self, labels: Mapping[str, str]) -> list[ListedSandbox]:
        return await asyncio.to_thread(_list_labelled, self._dir.parent, dict(labels))

    async def set_labels(self, handle: SandboxHandle, labels: Mapping[str, str]) -> None:
        sandbox = self._get(handle)
        await self._fs_op(_write_labels, sandbox.root, dict(labels))

    async def delete_listed(self, sandbox: ListedSandbox) -> None:
        own = self._sandboxes.get(sandbox.sandbox_id)
        if own is not None:
            await self.delete(own.handle)
            return
        # Another process's: its commands died with it (bubblewrap's --die-with-parent).
        root = Path(sandbox.info["root"])
        await asyncio.to_thread(self._remove_foreign, root)

    def _remove_foreign(self, root: Path) -> None:
        """Delete another process's sandbox tree, then its process's directory once that
        process is gone and no sandbox is left in it (one deleter at a time decides)."""
        local_tree.remove_tree(root)
        instance = root.parent
        with self._foreign_lock:
            if _instance_dead(instance) and not any(instance.glob("sbx-*")):
                with contextlib.suppress(FileNotFoundError):  # another process's reaper won
                    local_tree.remove_tree(instance)

    async def close(self) -> None:
        """Delete every live sandbox and this provider's directory."""
        await asyncio.gather(*(self.delete(s.handle) for s in list(self._sandboxes.values())))
        await asyncio.to_thread(local_tree.remove_tree, self._dir)
        if self._cgroups is not None:
            self._cgroups.close()

    def stats(self) -> dict[str, Any]:
        ms = sorted(self._create_ms)
        return {
            "sandboxes_alive": len(self._sandboxes),
            "commands_running": sum(len(s.runs) for s in self._sandboxes.values()),
            "create_ms_p50": ms[len(ms) // 2] if ms else None,
            "caps": self.caps,
        }


def _extract_single(data: bytes, name: str, local: Path) -> None:
    """Unpack a one-entry tar (file or directory `name`) to `local`, replacing it."""
    local.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=local.parent) as tmp:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(tmp, filter="data")
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local)
        elif local.exists() or local.is_symlink():
            local.unlink()
        os.replace(os.path.join(tmp, name), local)


def _default_root() -> Path:
    """Memory-backed when possible: creating a tree is ~40 inodes, 100x faster on tmpfs."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and os.statvfs(shm).f_bavail > 0:
        return shm / "riptide-sandboxes"
    return Path(tempfile.gettempdir()) / "riptide-sandboxes"


def _on_tmpfs(path: Path) -> bool:
    """Whether `path` lies on a tmpfs (the longest matching mount point in /proc/mounts)."""
    best, fstype = "", ""
    resolved = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            mount = fields[1]
            inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, fstype = mount, fields[2]
    return fstype == "tmpfs"


_LABELS = "labels.json"


def _write_labels(root: Path, labels: dict[str, str]) -> None:
    """Replace a sandbox's labels atomically (a lister never reads half a file)."""
    partial = root / f".{_LABELS}.partial"
    partial.write_text(json.dumps(labels))
    os.replace(partial, root / _LABELS)


def _read_labels(root: Path) -> dict[str, str] | None:
    try:
        labels = json.loads((root / _LABELS).read_text())
    except (OSError, ValueError):
        return None
    return labels if isinstance(labels, dict) else None


def _list_labelled(base: Path, wanted: dict[str, str]) -> list[ListedSandbox]:
    """Every labelled sandbox under `base` (of any provider process) carrying `wanted`."""
    found = []
    for root in sorted(base.glob("*/sbx-*")):
        labels = _read_labels(root)
        if labels is not None and all(labels.get(k) == v for k, v in wanted.items()):
            found.append(ListedSandbox(root.name, labels, {"root": str(root)}))
    return found


def _instance_dead(instance: Path) -> bool:
    pid = instance.name.split("-", 1)[0]
    return pid.isdigit() and not Path(f"/proc/{pid}").exists()


def _remove_dead_instances(base: Path) -> None:
    """Remove what providers whose process is gone (a crash) left, except their labelled
    sandboxes: those belong to their run, whose reaper deletes them (never another run's)."""
    for entry in base.iterdir():
        if not _instance_dead(entry):
            continue
        kept = [root for root in entry.glob("sbx-*") if _read_labels(root) is not None]
        if not kept:
            local_tree.remove_tree(entry)
            continue
        for child in entry.iterdir():
            if child not in kept:
                local_tree.remove_tree(child)
