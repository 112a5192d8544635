"""Per-sandbox memory and process caps through cgroups, as far as the host allows.

`CgroupHost.detect` looks at /proc/self/mountinfo at run time: cgroup v2 with the memory and
pids controllers (memory.max, memory.swap.max, pids.max in one directory), else v1 with
writable memory and pids hierarchies (memory.limit_in_bytes, memory.memsw.limit_in_bytes when
swap is accounted, pids.max). It returns None with the reason when neither can be written; the
local provider then keeps only its per-process rlimits and logs a warning.

Layout: `<hierarchy>/<parent>/<provider instance>/<sandbox id>`. Every command of a sandbox
joins its cgroup before it drops privileges and starts bubblewrap (`enter_argv`), so all its
processes, however many, share one memory and one process budget; delete kills what is left
in it and removes it. Used by providers/local.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.sandbox.provider import SandboxError

Kind = Literal["v1", "v2"]
#: Joins every cgroup.procs named in $1.. ($0 is their count) and execs the rest.
_ENTER = ('n=$0; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); '
          'done; exec "$@"')


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount this process sees."""
    found = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            pre, _, post = line.partition(" - ")
            fstype, _, options = post.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                found.append((pre.split()[4], fstype, set(options.split(","))))
    return found


def _write(path: Path, value: str) -> None:
    path.write_text(value)


@dataclass
class SandboxCgroup:
    """The cgroup directories of one sandbox (one for v2; memory and pids for v1)."""

    kind: Kind
    dirs: list[Path]

    def enter_argv(self) -> list[str]:
        """A command prefix that moves the command into this cgroup, then execs it."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        return ["/bin/sh", "-c", _ENTER, str(len(procs)), *procs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for directory in self.dirs:
            with contextlib.suppress(FileNotFoundError):
                found.update(int(p) for p in (directory / "cgroup.procs").read_text().split())
        return found

    def memory_peak_bytes(self) -> int:
        """The highest memory use of the sandbox so far (what the kernel accounted)."""
        name = "memory.peak" if self.kind == "v2" else "memory.max_usage_in_bytes"
        return int((self.dirs[0] / name).read_text())

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process in the cgroup until none is left."""
        if self.kind == "v2" and (self.dirs[0] / "cgroup.kill").exists():
            with contextlib.suppress(FileNotFoundError):
                _write(self.dirs[0] / "cgroup.kill", "1")
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise SandboxError(f"processes of cgroup {self.dirs[0]} survive SIGKILL: {pids}")
            time.sleep(0.005)

    def remove(self) -> None:
        """Kill what is left and remove the directories."""
        self.kill()
        for directory in self.dirs:
            _rmdir(directory)


def _rmdir(directory: Path, timeout_s: float = 5.0) -> None:
    """rmdir a cgroup; the kernel may need a moment after its last process is reaped."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class CgroupHost:
    """Where this provider instance makes its sandboxes' cgroups."""

    def __init__(self, kind: Kind, bases: list[Path]) -> None:
        self.kind = kind
        self.bases = bases  # v2: [instance dir]; v1: [memory instance dir, pids instance dir]

    @classmethod
    def detect(cls, parent: str, instance: str) -> tuple[CgroupHost | None, str]:
        """A usable hierarchy (v2 first, then v1) and a note; None and the reason if none."""
        mounts = _mounts()
        reasons = []
        for attempt in (cls._try_v2, cls._try_v1):
            try:
                host = attempt(mounts, parent, instance)
            except OSError as exc:
                reasons.append(f"{attempt.__name__[5:]}: {exc.strerror or exc}")
                continue
            if isinstance(host, str):
                reasons.append(host)
                continue
            try:
                host.create("probe", memory_mb=64, max_processes=8).remove()
            except OSError as exc:
                host.close()
                reasons.append(f"{host.kind}: {exc.strerror or exc}")
                continue
            return host, f"cgroup {host.kind} at {', '.join(map(str, host.bases))}"
        return None, "; ".join(reasons)

    @classmethod
    def _try_v2(cls, mounts: list[tuple[str, str, set[str]]], parent: str,
                instance: str) -> CgroupHost | str:
        for point, fstype, _ in mounts:
            if fstype != "cgroup2":
                continue
            root = Path(point)
            if not {"memory", "pids"} <= set((root / "cgroup.controllers").read_text().split()):
                continue
            path = root
            for part in [*Path(parent).parts, instance]:
                # A v2 controller reaches a child only when its parent delegates it.
                _write(path / "cgroup.subtree_control", "+memory +pids")
                path = path / part
                path.mkdir(exist_ok=True)
            _write(path / "cgroup.subtree_control", "+memory +pids")
            return cls("v2", [path])
        return "v2: no cgroup2 mount with the memory and pids controllers"

    @classmethod
    def _try_v1(cls, mounts: list[tuple[str, str, set[str]]], parent: str,
                instance: str) -> CgroupHost | str:
        points: dict[str, Path] = {}
        for point, fstype, options in mounts:
            for controller in ("memory", "pids"):
                if fstype == "cgroup" and controller in options:
                    points.setdefault(controller, Path(point))
        if set(points) != {"memory", "pids"}:
            return "v1: no memory and pids hierarchies mounted"
        bases = [points[c] / parent / instance for c in ("memory", "pids")]
        for base in bases:
            base.mkdir(parents=True, exist_ok=True)
        return cls("v1", bases)

    def create(self, name: str, memory_mb: int, max_processes: int) -> SandboxCgroup:
        """A fresh cgroup for one sandbox with its caps written."""
        memory, pids = str(memory_mb << 20), str(max_processes)
        dirs = [base / name for base in self.bases]
        for directory in dirs:
            directory.mkdir()
        group = SandboxCgroup(self.kind, dirs)
        try:
            if self.kind == "v2":
                _write(dirs[0] / "memory.max", memory)
                if (dirs[0] / "memory.swap.max").exists():
                    _write(dirs[0] / "memory.swap.max", "0")
                _write(dirs[0] / "pids.max", pids)
            else:
                _write(dirs[0] / "memory.limit_in_bytes", memory)
                if (dirs[0] / "memory.memsw.limit_in_bytes").exists():  # swap accounted
                    _write(dirs[0] / "memory.memsw.limit_in_bytes", memory)
                _write(dirs[1] / "pids.max", pids)
        except OSError:
            group.remove()
            raise
        return group

    def close(self) -> None:
        """Remove this instance's directories (every sandbox cgroup must be gone)."""
        for base in self.bases:
            with contextlib.suppress(OSError):
                base.rmdir()

    def remove_dead_instances(self) -> None:
        """Remove cgroups left by provider instances whose process is gone (a crash)."""
        for base in self.bases:
            for entry in base.parent.iterdir():
                pid = entry.name.split("-", 1)[0]
                if entry.is_dir() and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    for child in entry.iterdir():
                        if child.is_dir():
                            SandboxCgroup(self.kind, [child]).remove()
                    _rmdir(entry)
