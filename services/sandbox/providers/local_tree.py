"""The directory tree a local sandbox sees as `/`, and how it is filled from a task.

Layout of one sandbox on the host: `<root>/<sandbox_id>/fs/` is the sandbox's writable `/`.
It starts as a copy of a small skeleton (mount points, symlinks like `/bin -> usr/bin`, a
minimal `/etc` of its own) plus the task's files: every `COPY`/`ADD` of the task's
`environment/Dockerfile` whose source is in the build context is applied to the tree in order
(`RUN` is not executed), and the Dockerfile's WORKDIR is created. System directories (`/usr`,
and `/bin`, `/lib*` where they are real directories) are bind-mounted read-only from the host.
Where the provider may mount (root), `<root>/<sandbox_id>` is a tmpfs of its own whose size is
the task's storage, so everything the sandbox writes, in any number of files, stops there.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.provider import SandboxError
from services.sandbox.task import Task

_TOP_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ETC_COPIED = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "profile", "profile.d",
    "bash.bashrc", "inputrc", "timezone",
)
_ETC_WRITTEN = {
    "passwd": "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:"
    "/usr/sbin/nologin\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost ip6-loopback\n",
    "hostname": "sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files\n",
    "resolv.conf": "",
}
_DIRS = {"app": 0o755, "tmp": 0o1777, "root": 0o700, "home": 0o755, "logs": 0o755,
         "var": 0o755, "var/tmp": 0o1777, "run": 0o755, "opt": 0o755, "srv": 0o755}


def host_system_binds() -> list[str]:
    """Host directories bound read-only into every sandbox."""
    binds = ["/usr"]
    for name in _TOP_LINKS:
        path = Path("/") / name
        if path.is_dir() and not path.is_symlink():
            binds.append(str(path))
    if Path("/etc/alternatives").is_dir():  # symlinks into /usr (awk, editors...)
        binds.append("/etc/alternatives")
    return binds


def build_skeleton(dest: Path, ro_binds: list[str]) -> None:
    """Write the template every sandbox tree is copied from."""
    dest.mkdir(parents=True)
    for mount in [*ro_binds, "/proc", "/dev"]:
        (dest / mount.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for name in _TOP_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            (dest / name).symlink_to(os.readlink(host))
    for rel, mode in _DIRS.items():
        (dest / rel).mkdir(parents=True, exist_ok=True)
        os.chmod(dest / rel, mode)
    etc = dest / "etc"
    etc.mkdir(exist_ok=True)
    for name in _ETC_COPIED:
        src = Path("/etc") / name
        if src.is_symlink():
            (etc / name).symlink_to(os.readlink(src))
        elif src.is_dir():
            shutil.copytree(src, etc / name, symlinks=True)
        elif src.is_file():
            shutil.copy2(src, etc / name)
    for name, text in _ETC_WRITTEN.items():
        (etc / name).write_text(text)


@dataclass(frozen=True)
class _Copy:
    source: Path
    target: str
    """Relative to the sandbox root."""


def copy_plan(task: Task, ro_binds: list[str]) -> tuple[list[_Copy], list[str]]:
    """The files to put in a sandbox for `task` (from its Dockerfile's COPY/ADD) and the
    directories to create (its WORKDIR); raises SandboxError for what cannot be honored."""
    context = task.environment_dir.resolve()
    copies: list[_Copy] = []
    facts = task.dockerfile
    for step in facts.copies if facts else ():
        where = f"{task.environment_dir / 'Dockerfile'} line {step.line}"
        if any(step.dest == b or step.dest.startswith(b + "/") for b in [*ro_binds, "/proc"]):
            raise SandboxError(
                f"{where}: copies into {step.dest}, which local sandboxes mount read-only from "
                "the host; copy into /app (or another non-system directory) instead"
            )
        for pattern in step.sources:
            matches = sorted(glob.glob(str(context / pattern))) if glob.has_magic(pattern) else [
                str(context / pattern)
            ]
            if not matches or not all(os.path.lexists(m) for m in matches):
                raise SandboxError(f"{where}: source {pattern!r} not found in {context}")
            for match in matches:
                source = Path(match).resolve()
                if source != context and context not in source.parents:
                    raise SandboxError(f"{where}: source {pattern!r} is outside the build context")
                target = step.dest
                if source.is_file() and step.dest_is_dir:
                    target = f"{step.dest.rstrip('/')}/{source.name}"
                copies.append(_Copy(source, target.lstrip("/")))
    return copies, [task.workdir.lstrip("/")]


def populate(fs: Path, skeleton: Path, copies: list[_Copy], dirs: list[str]) -> None:
    """Fill a fresh sandbox tree: the skeleton, then the task's files."""
    shutil.copytree(skeleton, fs, symlinks=True)
    for item in copies:
        target = fs / item.target
        if item.source.is_dir():
            shutil.copytree(item.source, target, symlinks=True, dirs_exist_ok=True)
        else:
            if target.is_dir():
                target = target / item.source.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(item.source, target)
    for rel in dirs:
        (fs / rel).mkdir(parents=True, exist_ok=True)


def chown_tree(path: Path, uid: int) -> None:
    """Give the whole tree to the sandbox's host uid (it shows as root inside)."""
    os.lchown(path, uid, uid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_tmpfs(path: Path, size_mb: int) -> None:
    """Mount a tmpfs of `size_mb` MiB at `path` (an empty directory); OSError if not allowed."""
    options = f"size={size_mb}m,mode=0700".encode()
    if _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, options):
        code = ctypes.get_errno()
        raise OSError(code, f"mount tmpfs at {path}: {os.strerror(code)}")


def unmount(path: Path) -> None:
    """Detach the mount at `path` (its files go with it); nothing if none is there."""
    if _libc().umount2(os.fsencode(path), _MNT_DETACH):
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point
            raise OSError(code, f"unmount {path}: {os.strerror(code)}")


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below `path`, deepest first."""
    prefix = str(path.resolve()).rstrip("/") + "/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    inside = [Path(p) for p in points if p.startswith(prefix) or p + "/" == prefix]
    return sorted(set(inside), key=lambda p: len(p.parts), reverse=True)


def remove_tree(path: Path) -> None:
    """Delete a sandbox tree, including directories the sandbox made unreadable."""

    def _retry(func, target, _exc):  # type: ignore[no-untyped-def]
        parent = os.path.dirname(target)
        os.chmod(parent, 0o700)
        if os.path.isdir(target) and not os.path.islink(target):
            os.chmod(target, 0o700)
        func(target)

    for mount in mounts_under(path) if path.exists() else []:
        unmount(mount)
    if path.exists():
        shutil.rmtree(path, onerror=_retry)
