"""SIGKILL the sandbox service with episodes in flight, on the Daytona stand-in and on local
sandboxes: after the restart every orphan of the killed incarnation is deleted within
REAP_BOUND_S of the new service being ready, no sandbox of another run is touched, and
nothing of the run is left once the service stops at the run's end.

Real processes throughout: `riptide serve sandbox` (scripted oracle client; the task's
solution sleeps, so episodes stay in flight), the Daytona stand-in speaking the SDK's API,
bubblewrap sandboxes. The other run is a second sandbox service, SIGKILLed too, whose orphan
has a short, lapsed lease: the most tempting target a careless reaper could take.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from services._proto.riptide.v1 import sandbox_pb2, sandbox_pb2_grpc
from services.common import process
from services.common.ports import free_ports
from services.sandbox.config import DaytonaProviderConfig
from services.sandbox.leases import INCARNATION
from services.sandbox.provider import ListedSandbox, SandboxProvider
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.testing.daytona_server import DaytonaServer

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ADMIN = "admin-token-orphans"
#: The bound this test holds the reaper to: the restarted service's first sweep runs at
#: start-up, so its predecessor's orphans go within one list plus the deletes.
REAP_BOUND_S = 10.0
NUM_IN_FLIGHT = 3


@pytest.fixture(scope="module")
def tasks_dir() -> Iterator[Path]:
    """One bundled task whose solution sleeps: an oracle episode stays in flight."""
    root = Path(tempfile.mkdtemp(prefix="riptide-orphan-tasks-"))
    shutil.copytree(REPO / "tasks" / "csv-revenue", root / "slow")
    (root / "slow" / "solution" / "solve.sh").write_text("#!/bin/bash\nsleep 300\n")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def daytona(tasks_dir: Path) -> Iterator[DaytonaServer]:
    with DaytonaServer(tasks_dir) as server:
        yield server


class SandboxService:
    """One `riptide serve sandbox` process of a run; restartable on the same ports."""

    def __init__(self, tmp: Path, run: str, provider_toml: str, tasks_dir: Path,
                 env: dict[str, str], extra: str = "") -> None:
        self.grpc_port, self.admin_port = free_ports(2)
        self.config = tmp / f"{run}.toml"
        self.config.write_text(
            f'[run]\nname = "{run}"\nadmin_token = "{ADMIN}"\nlog_format = "text"\n'
            f"[sandbox]\ngrpc_port = {self.grpc_port}\nadmin_port = {self.admin_port}\n"
            f'tasks_dir = "{tasks_dir}"\nmodel_client = "scripted"\n'
            f"reap_interval_s = 1.0\nlease_s = 2.0\nlease_renew_interval_s = 1.0\n{extra}"
            f'[sandbox.scripted]\npolicy = "oracle"\n{provider_toml}')
        self.log, self.env = tmp / f"{run}.log", env
        self.proc: Any = None

    def start(self) -> float:
        """Start and wait until ready; the seconds it took."""
        started = time.monotonic()
        self.proc = process.spawn([sys.executable, "-m", "services.cli", "serve", "sandbox",
                                   "--config", str(self.config)], log_path=self.log,
                                  env=self.env)
        while time.monotonic() - started < 60:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{self.admin_port}/readyz",
                             timeout=0.5).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"sandbox service not ready: {self.log.read_text()[-2000:]}")

    def state(self) -> dict[str, Any]:
        reply = httpx.get(f"http://127.0.0.1:{self.admin_port}/admin/state", timeout=10,
                          headers={"Authorization": f"Bearer {ADMIN}"})
        return dict(reply.json()["details"])

    def start_episodes(self, count: int, prefix: str) -> None:
        """`count` episodes in the background; each stream is read until it breaks."""
        def read(sample_id: str) -> None:
            with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
                stub = sandbox_pb2_grpc.SandboxStub(channel)
                try:
                    for _ in stub.RunEpisode(sandbox_pb2.RunEpisodeRequest(
                            task_id="slow", sample_id=sample_id, group_id=prefix)):
                        pass
                except grpc.RpcError:
                    pass  # the service was killed or stopped under it

        for i in range(count):
            threading.Thread(target=read, args=(f"{prefix}-{i}",), daemon=True).start()
        wait_for(lambda: self.state()["sandboxes_alive"] == count, 60,
                 f"{count} sandboxes of {prefix} alive")

    def sigkill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # the service's own process group
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            process.stop(self.proc, grace_s=30.0)


def wait_for(predicate: Any, timeout_s: float, what: str) -> float:
    """Poll until `predicate()`; the seconds it took."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - started


class Lister:
    """A provider in this process on one event loop (an SDK client belongs to its loop),
    looking at the provider as the services see it."""

    def __init__(self, provider: SandboxProvider) -> None:
        self.provider, self.loop = provider, asyncio.new_event_loop()

    def __call__(self, run: str) -> list[ListedSandbox]:
        return self.loop.run_until_complete(self.provider.list_sandboxes({"riptide.run": run}))

    def close(self, delete_run: str) -> None:
        for sandbox in self(delete_run):
            self.loop.run_until_complete(self.provider.delete_listed(sandbox))
        self.loop.run_until_complete(self.provider.close())
        self.loop.close()


@pytest.mark.parametrize("kind", ["daytona", "local"])
def test_orphans_of_a_killed_sandbox_service_are_reaped_after_its_restart(
        kind: str, daytona: DaytonaServer, tasks_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    trees = Path(tempfile.mkdtemp(prefix="riptide-orphan-trees-"))
    trees.chmod(0o711)
    env = {**os.environ, "DAYTONA_API_KEY": daytona.api_key}
    if kind == "daytona":
        provider_toml = (f'[sandbox.provider]\ntype = "daytona"\napi_url = "{daytona.api_url}"\n'
                         'image_template = "riptide-tasks/{task}:latest"\n')
        monkeypatch.setenv("DAYTONA_API_KEY", daytona.api_key)
        from services.sandbox.providers.daytona import DaytonaProvider

        _listed = Lister(DaytonaProvider(DaytonaProviderConfig(api_url=daytona.api_url)))
    else:
        provider_toml = f'[sandbox.provider]\ntype = "local"\nroot_dir = "{trees}"\n'
        _listed = Lister(LocalProvider(LocalProviderConfig(root_dir=trees)))
    run = f"faulty-{kind}"
    bystander = SandboxService(tmp_path, f"bystander-{kind}", provider_toml, tasks_dir, env,
                               extra="lease_create_grace_s = 0.0\n")
    service = SandboxService(tmp_path, run, provider_toml, tasks_dir, env)
    try:
        # Another run's service dies too; its orphan's lease lapses within 2 s.
        bystander.start()
        bystander.start_episodes(1, "by")
        bystander.sigkill()
        bystanders = _listed(f"bystander-{kind}")
        assert len(bystanders) == 1

        service.start()
        killed = service.state()["lifecycle"]["incarnation"]
        service.start_episodes(NUM_IN_FLIGHT, "ep")
        service.sigkill()
        orphans = [s for s in _listed(run) if s.labels[INCARNATION] == killed]
        assert len(orphans) == NUM_IN_FLIGHT, "the kill left no orphans to reap"
        time.sleep(2.5)  # every lease involved has lapsed now: only the run label protects

        ready_s = service.start()
        reaped_s = wait_for(lambda: not any(s.labels[INCARNATION] == killed
                                            for s in _listed(run)),
                            REAP_BOUND_S, "the killed incarnation's orphans to go")
        state = service.state()
        print(f"{kind}: restart ready in {ready_s:.2f} s; {NUM_IN_FLIGHT} orphans reaped "
              f"{reaped_s:.2f} s after ready; reaper {state['reaper']}")
        assert state["reaper"]["reaped"] == {"incarnation_gone": NUM_IN_FLIGHT}
        assert state["lifecycle"]["num_reaped"] == NUM_IN_FLIGHT
        assert [s.sandbox_id for s in _listed(f"bystander-{kind}")] == \
            [s.sandbox_id for s in bystanders], "a sandbox of another run was touched"

        # The run goes on, then ends with an episode in flight: nothing of it is left.
        service.start_episodes(1, "late")
        service.stop()
        assert _listed(run) == []
        if kind == "local":  # no tree of the run anywhere, the killed process's included
            assert {str(p) for p in trees.glob("*/sbx-*")} == \
                {str(s.info["root"]) for s in bystanders}
    finally:
        service.stop()
        bystander.stop()
        _listed.close(delete_run=f"bystander-{kind}")
        shutil.rmtree(trees, ignore_errors=True)
