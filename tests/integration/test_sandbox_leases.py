"""Leases and the reaper against each provider that lists its sandboxes: local trees, and
Daytona through the real SDK against the stand-in (its list, label and page API).

One provider object stands for the service that made the sandboxes, a second one for the
service that came after it; the reaper of the second deletes the first's orphans of its run
and nothing of another run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common import process
from services.sandbox.config import DaytonaProviderConfig
from services.sandbox.leases import INCARNATION, LEASE_UNTIL, Leases, Owner, lease_until
from services.sandbox.provider import SandboxError, SandboxProvider
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.reaper import Reaper
from services.sandbox.task import TaskSet
from services.testing.daytona_server import DaytonaServer

REPO = Path(__file__).resolve().parents[2]
TASK = TaskSet.load(REPO / "tasks").get("csv-revenue")
KINDS = ["local", "daytona"]


@pytest.fixture(scope="module")
def daytona() -> Iterator[DaytonaServer]:
    with DaytonaServer(REPO / "tasks") as server:
        yield server


@pytest.fixture
def trees() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="riptide-test-trees-"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _make(kind: str, daytona: DaytonaServer, trees: Path,
          monkeypatch: pytest.MonkeyPatch) -> SandboxProvider:
    if kind == "local":
        return LocalProvider(LocalProviderConfig(root_dir=trees))
    from services.sandbox.providers.daytona import DaytonaProvider

    monkeypatch.setenv("DAYTONA_API_KEY", daytona.api_key)
    return DaytonaProvider(DaytonaProviderConfig(
        api_url=daytona.api_url, image_template="riptide-tasks/{task}:latest"))


@pytest.mark.parametrize("kind", KINDS)
def test_a_restarted_service_reaps_its_predecessors_sandboxes_and_no_other_runs(
        kind: str, daytona: DaytonaServer, trees: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    before, after = (_make(kind, daytona, trees, monkeypatch) for _ in range(2))
    old = Leases(before, Owner("run-a", "host:8053", "old"), lease_s=600)
    other_run = Leases(before, Owner("run-b", "host:8053", "other"), lease_s=600)
    new = Leases(after, Owner("run-a", "host:8053", "new"), lease_s=600)

    async def run() -> None:
        mine = [await before.create(TASK, labels=old.labels(TASK.name, f"e{i}"))
                for i in range(2)]
        foreign = await before.create(TASK, labels=other_run.labels(TASK.name, "x"))
        listed = await after.list_sandboxes({"riptide.run": "run-a"})
        assert {s.sandbox_id for s in listed} == {h.sandbox_id for h in mine}
        assert {s.labels[INCARNATION] for s in listed} == {"old"}

        # A renewal shows in the listing of every process.
        old.track(mine[0], old.labels(TASK.name, "e0"))
        old.lease_s = 3600
        await old.renew_all()
        renewed = {s.sandbox_id: lease_until(s.labels)
                   for s in await after.list_sandboxes({"riptide.run": "run-a"})}
        assert renewed[mine[0].sandbox_id] == pytest.approx(time.time() + 3600, abs=5)
        assert old.num_leased() == 1

        reaper = Reaper(after, new, set)
        assert await reaper.sweep() == 2
        assert reaper.reaped == {"incarnation_gone": 2}
        assert await after.list_sandboxes({"riptide.run": "run-a"}) == []
        for handle in mine:  # gone for their maker too
            with pytest.raises(SandboxError):
                await before.exec(handle, "true", 10)
        left = await after.list_sandboxes({"riptide.run": "run-b"})
        assert [s.sandbox_id for s in left] == [foreign.sandbox_id]
        assert (await before.exec(foreign, "echo alive", 10)).stdout == "alive\n"
        await before.delete(foreign)
        await before.close()
        await after.close()

    asyncio.run(run())


@pytest.mark.parametrize("kind", KINDS)
def test_another_instances_sandbox_goes_only_when_its_lease_lapsed(
        kind: str, daytona: DaytonaServer, trees: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    provider = _make(kind, daytona, trees, monkeypatch)
    elsewhere = Leases(provider, Owner("run-c", "other-host:8053", "e1"), lease_s=600)
    here = Leases(provider, Owner("run-c", "host:8053", "h1"), lease_s=600)

    async def run() -> None:
        labels = elsewhere.labels(TASK.name, "e")
        handle = await provider.create(TASK, labels=labels)
        reaper = Reaper(provider, here, set)
        assert await reaper.sweep() == 0  # its service may be alive: the lease holds
        await provider.set_labels(handle, {**labels, LEASE_UNTIL: str(int(time.time()) - 1)})
        assert await reaper.sweep() == 1 and reaper.reaped == {"lease_lapsed": 1}
        assert await provider.list_sandboxes({"riptide.run": "run-c"}) == []
        await provider.close()

    asyncio.run(run())


def test_a_dead_processes_local_orphans_go_at_once_and_its_directory_with_them(
        trees: Path) -> None:
    # A real process makes 8 labelled sandboxes and is SIGKILLed; 8 concurrent deletes
    # must each succeed, and the last one removes the dead process's directory.
    maker = process.spawn([sys.executable, "-m", "services.testing.orphan_maker", str(trees),
                           str(REPO / "tasks"), TASK.name, "8", "run-d", "host:1", "dead"])
    try:
        deadline = time.monotonic() + 60
        while len(list(trees.glob("*/sbx-*/labels.json"))) < 8:
            assert maker.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        os.killpg(maker.pid, signal.SIGKILL)
        maker.wait(10)
    provider = LocalProvider(LocalProviderConfig(root_dir=trees))
    reaper = Reaper(provider, Leases(provider, Owner("run-d", "host:1", "new")), set)

    async def run() -> None:
        assert await reaper.sweep() == 8
        assert reaper.reaped == {"incarnation_gone": 8} and reaper.delete_failures == 0
        await provider.close()

    asyncio.run(run())
    assert list(trees.iterdir()) == []


def test_the_stand_in_lists_in_pages_as_daytona_does(daytona: DaytonaServer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from daytona import AsyncDaytona, DaytonaConfig, ListSandboxesQuery

    provider = _make("daytona", daytona, Path(), monkeypatch)
    leases = Leases(provider, Owner("run-pages", "host:1", "p"))

    async def run() -> None:
        handles = [await provider.create(TASK, labels=leases.labels(TASK.name, f"p{i}"))
                   for i in range(3)]
        async with AsyncDaytona(DaytonaConfig(api_key=daytona.api_key,
                                              api_url=daytona.api_url)) as client:
            pages_before = daytona.state()["list_requests"]
            found = [s.id async for s in client.list(ListSandboxesQuery(
                labels={"riptide.run": "run-pages"}, limit=1))]
            assert daytona.state()["list_requests"] - pages_before == 3
        assert sorted(found) == sorted(h.sandbox_id for h in handles)
        for handle in handles:
            await provider.delete(handle)
        await provider.close()

    asyncio.run(run())
