"""Escape attempts from a local (bubblewrap) sandbox fail: network, host files, fork bombs,
timeouts, leftovers. Network use is loopback only: the host side listens on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.sandbox.provider import SandboxError, SandboxHandle
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.providers.local_uids import pids_of_uid
from services.sandbox.task import Task
from services.testing.probe_task import probe_task

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the tests count processes by uid")

@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    return probe_task(tmp_path_factory.mktemp("task") / "probe", memory="256M", storage="4M",
                      app_files={"hello.txt": "hello\n"})


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalProvider]:
    provider = LocalProvider(LocalProviderConfig(max_processes=64))
    yield provider
    asyncio.run(provider.close())


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def leftovers(handle: SandboxHandle) -> list[int]:
    """Processes still alive for this sandbox: its uid (ours alone) or its marker variable."""
    uid = handle.info["uid"]
    found = set(pids_of_uid(uid))
    marker = f"RIPTIDE_SANDBOX_ID={handle.sandbox_id}".encode()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != str(os.getpid()):
            try:  # only our own sandbox children can carry this marker
                if os.stat(f"/proc/{pid}").st_uid == uid and marker in open(
                    f"/proc/{pid}/environ", "rb"
                ).read():
                    found.add(int(pid))
            except OSError:
                continue
    return sorted(found)


def test_basic_view(provider: LocalProvider, task: Task) -> None:
    async def go() -> None:
        handle = await provider.create(task)
        try:
            r = await provider.exec(
                handle, "pwd; cat hello.txt; id -u; ls /proc | grep -c '^[0-9]'", timeout_s=10
            )
            lines = r.stdout.split()
            assert r.exit_code == 0 and lines[:3] == ["/app", "hello", "0"], r.output
            assert int(lines[3]) < 10, "the sandbox sees processes outside its pid namespace"
            r = await provider.exec(handle, "touch /usr/x", timeout_s=10)
            assert r.exit_code != 0 and "Read-only file system" in r.output
        finally:
            await provider.delete(handle)

    run(go())


def test_no_network(provider: LocalProvider, task: Task) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_name = f"\0riptide-test-{os.getpid()}"
    abstract.bind(abstract_name)
    abstract.listen(1)
    script = (
        "import socket\n"
        "print(sorted(n for _, n in socket.if_nameindex()))\n"
        f"s = socket.socket(); s.settimeout(3)\n"
        f"try:\n    s.connect(('127.0.0.1', {port})); print('CONNECTED')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
        "u = socket.socket(socket.AF_UNIX)\n"
        f"try:\n    u.connect({abstract_name!r}); print('UNIX-CONNECTED')\n"
        "except OSError as e:\n    print('unix refused', e.errno)\n"
    )

    async def go() -> str:
        handle = await provider.create(task)
        try:
            r = await provider.exec(handle, f"python3 -c \"{script}\"", timeout_s=20)
            assert r.exit_code == 0, r.output
            return r.stdout
        finally:
            await provider.delete(handle)

    try:
        out = run(go())
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's socket
    finally:
        listener.close()
        abstract.close()
    assert out.splitlines()[0] == "['lo']", out  # loopback only: no route anywhere else
    assert "CONNECTED" not in out.replace("UNIX-CONNECTED", "") and "refused" in out
    assert "UNIX-CONNECTED" not in out and "unix refused" in out


def test_host_files_invisible(provider: LocalProvider, task: Task, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-7f3a\n")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)  # even world-readable host files stay out of reach

    async def go() -> str:
        handle = await provider.create(task)
        try:
            cmd = (f"cat {secret}; ls /work /home /root/.ssh {Path.home()}; "
                   f"cat /proc/1/root{secret}; grep -r TOP-SECRET /tmp /etc /root /app; true")
            return (await provider.exec(handle, cmd, timeout_s=20)).output
        finally:
            await provider.delete(handle)

    out = run(go())
    assert "TOP-SECRET-7f3a" not in out
    assert "No such file or directory" in out


@pytest.mark.slow
def test_fork_bomb_is_contained(provider: LocalProvider, task: Task) -> None:
    async def go() -> None:
        handle = await provider.create(task)
        peak = 0
        host_latency_s = 0.0

        async def watch() -> None:
            nonlocal peak, host_latency_s
            while True:
                peak = max(peak, len(pids_of_uid(handle.info["uid"])))
                start = time.monotonic()
                await asyncio.to_thread(subprocess.run, ["true"], check=True)
                host_latency_s = max(host_latency_s, time.monotonic() - start)
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch())
        try:
            start = time.monotonic()
            r = await provider.exec(handle, "bomb() { bomb | bomb & }; bomb; sleep 30",
                                    timeout_s=4)
            elapsed = time.monotonic() - start
        finally:
            watcher.cancel()
            await provider.delete(handle)
        assert r.timed_out and r.exit_code is None and elapsed < 15
        assert 0 < peak <= 64 + 2, f"sandbox reached {peak} processes"
        assert host_latency_s < 5.0, f"host took {host_latency_s:.1f}s to start a process"
        assert leftovers(handle) == []

    run(go())


def test_command_cannot_outlive_timeout(provider: LocalProvider, task: Task) -> None:
    async def go() -> None:
        handle = await provider.create(task)
        try:
            start = time.monotonic()
            r = await provider.exec(
                handle, "sleep 100 & (setsid sleep 200 &); nohup sleep 300 >/dev/null 2>&1 & "
                "echo started; sleep 400", timeout_s=1.0,
            )
            assert r.timed_out and r.exit_code is None and "started" in r.stdout
            assert time.monotonic() - start < 10
            assert leftovers(handle) == []
            # a background child of a finished command does not hold the call or survive it
            start = time.monotonic()
            r = await provider.exec(handle, "sleep 100 & echo bye", timeout_s=30)
            assert (r.exit_code, r.stdout.strip(), r.timed_out) == (0, "bye", False)
            assert time.monotonic() - start < 10
            assert leftovers(handle) == []
        finally:
            await provider.delete(handle)

    run(go())


def test_delete_kills_running_command_and_removes_tree(
    provider: LocalProvider, task: Task
) -> None:
    async def go() -> None:
        handle = await provider.create(task)
        tree = Path(handle.info["root"])
        running = asyncio.create_task(
            provider.exec(handle, "sleep 100 & sleep 200", timeout_s=60)
        )
        await asyncio.sleep(0.5)
        assert leftovers(handle)
        await provider.delete(handle)
        with pytest.raises(SandboxError):
            await running
        assert leftovers(handle) == [] and not tree.exists()
        await provider.delete(handle)  # idempotent
        with pytest.raises(SandboxError, match="does not exist"):
            await provider.exec(handle, "true", timeout_s=5)

    run(go())


def test_memory_and_file_size_caps(provider: LocalProvider, task: Task) -> None:
    async def go() -> None:
        handle = await provider.create(task)
        try:
            r = await provider.exec(
                handle, "python3 -c 'x = bytearray(512 * 1024 * 1024); print(len(x))'",
                timeout_s=20,
            )
            assert r.exit_code != 0 and "MemoryError" in r.output
            r = await provider.exec(handle, "head -c 8M /dev/zero > /app/big; stat -c %s big",
                                    timeout_s=20)
            # the per-file cap, or the tree's own 4 MiB tmpfs (which holds a little more)
            stopped = "File size limit exceeded" in r.output or "No space left" in r.output
            assert stopped and int(r.stdout.split()[-1]) <= 4194304, r.output
        finally:
            await provider.delete(handle)

    run(go())


def test_output_is_capped(task: Task) -> None:
    provider = LocalProvider(LocalProviderConfig(max_output_kb=4))

    async def go() -> None:
        handle = await provider.create(task)
        try:
            r = await provider.exec(handle, "echo START; yes | head -c 1000000; echo; echo END",
                                    timeout_s=20)
            assert r.exit_code == 0 and r.output_truncated and len(r.stdout) < 4200
            assert r.stdout.startswith("START") and r.stdout.rstrip().endswith("END")
        finally:
            await provider.delete(handle)
            await provider.close()

    run(go())


def test_32_concurrent_sandboxes_leave_nothing_behind(
    provider: LocalProvider, task: Task
) -> None:
    async def one() -> SandboxHandle:
        handle = await provider.create(task)
        try:
            r = await provider.exec(
                handle, "echo $RIPTIDE_SANDBOX_ID > /app/id; sleep 0.2 & cat id", timeout_s=30
            )
            assert r.stdout.strip() == handle.sandbox_id
        finally:
            await provider.delete(handle)
        return handle

    async def go() -> list[SandboxHandle]:
        return await asyncio.gather(*(one() for _ in range(32)))

    handles = run(go())
    assert len({h.info["uid"] for h in handles}) >= 1
    assert all(leftovers(h) == [] for h in handles)
    assert all(not Path(h.info["root"]).exists() for h in handles)
    assert provider.stats()["sandboxes_alive"] == 0


def test_broken_bubblewrap_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="no unsandboxed fallback"):
        LocalProvider(LocalProviderConfig(bwrap_path="/bin/false", root_dir=tmp_path))


def test_bubblewrap_is_looked_up_on_path_by_default(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The default `bwrap` is found on PATH (a node where it is unpacked elsewhere); a name
    that is not there is named in the error, with the fix."""
    real = shutil.which("bwrap")
    assert real is not None
    elsewhere = Path(tempfile.mkdtemp(prefix="riptide-bin-"))  # the sandboxes' uids run it
    try:
        elsewhere.chmod(0o755)
        (elsewhere / "bwrap").symlink_to(real)
        monkeypatch.setenv("PATH", f"{elsewhere}:/usr/bin:/bin")
        provider = LocalProvider(LocalProviderConfig(root_dir=elsewhere / "sandboxes"))
        assert provider.config.bwrap_path == str(elsewhere / "bwrap")
        run(provider.close())
    finally:
        shutil.rmtree(elsewhere)
    with pytest.raises(SandboxError, match=r"bubblewrap not found on PATH \('no-such-bwrap'\)"):
        LocalProvider(LocalProviderConfig(bwrap_path="no-such-bwrap", root_dir=tmp_path))


UNPRIVILEGED_SCRIPT = """
import asyncio, sys
from pathlib import Path
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import Task
from services.testing.probe_task import probe_task

FORKS = '''
import os, time
n = 0
try:
    while n < 500:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        n += 1
except OSError:
    pass
print("forks", n)
'''

async def main():
    provider = LocalProvider(LocalProviderConfig(root_dir=Path(sys.argv[1]), max_processes=32))
    handle = await provider.create(Task.load(sys.argv[2]))
    result = await provider.exec(handle, f"id -u; python3 -c '{FORKS}'", timeout_s=30)
    print(result.stdout, end="")
    await provider.delete(handle)
    await provider.close()

asyncio.run(main())
"""


def test_unprivileged_user_mode() -> None:
    """As an ordinary user (no uid of its own per sandbox) the limits still hold."""
    system_python = "/usr/bin/python3"
    site = Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{site.parents[3]}:{site}", "HOME": "/"}
    probe = subprocess.run([system_python, "-c", "import pydantic"], env=env,
                           capture_output=True, user=65534, group=65534, extra_groups=[])
    if probe.returncode:
        pytest.skip("no system python able to import the venv's packages as an ordinary user")
    root = Path(tempfile.mkdtemp(prefix="riptide-unpriv-"))
    try:
        os.chown(root, 65534, 65534)
        proc = subprocess.run(
            [system_python, "-c", UNPRIVILEGED_SCRIPT, str(root / "sandboxes"),
             str(site.parents[3] / "tasks" / "config-edit")],
            env=env, capture_output=True, text=True, timeout=120, user=65534, group=65534,
            extra_groups=[], start_new_session=True, cwd="/",
        )
    finally:
        shutil.rmtree(root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    uid, forks = proc.stdout.split("\n")[:2]
    assert uid == "0" and 10 < int(forks.split()[1]) <= 32, proc.stdout
