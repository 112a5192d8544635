"""Sandbox-wide caps of local sandboxes: storage across many files stops at the task's storage
(a tmpfs per tree), memory across many processes at the task's memory (a cgroup per sandbox),
and the host is unaffected; without cgroups or mounts the provider says so and falls back."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import Task
from services.testing.probe_task import probe_task

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and mounts need root")
MEMORY_MB, STORAGE_MB = 128, 16



@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    return probe_task(tmp_path_factory.mktemp("task") / "caps", memory=f"{MEMORY_MB}M",
                      storage=f"{STORAGE_MB}M")


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalProvider]:
    provider = LocalProvider(LocalProviderConfig(max_processes=64))
    yield provider
    asyncio.run(provider.close())


def _host_available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_storage_across_many_files_stops_at_the_task_storage(
        provider: LocalProvider, task: Task) -> None:
    if provider.caps["storage"] != "tmpfs per sandbox":
        pytest.skip(f"this host gives no tmpfs per sandbox: {provider.caps}")

    async def go() -> str:
        handle = await provider.create(task)
        try:  # 64 files of 1 MiB each, every one far under the per-file cap
            r = await provider.exec(
                handle, "for i in $(seq 64); do head -c 1M /dev/zero > /app/f$i || break; "
                "done; du -sk /app | cut -f1", timeout_s=30)
            return r.output
        finally:
            await provider.delete(handle)

    out = asyncio.run(go())
    assert "No space left on device" in out, out
    written_kb = int(out.split()[-1])
    assert STORAGE_MB * 1024 * 0.5 < written_kb <= STORAGE_MB * 1024, out


def test_memory_across_many_processes_stops_at_the_task_memory(
        provider: LocalProvider, task: Task) -> None:
    if provider.caps["memory"] == "rlimits per process":
        pytest.skip(f"this host gives no writable cgroup: {provider.caps}")
    # Eight processes of 48 MiB each, every one under the per-process cap: 384 MiB in all.
    hog = "python3 -c 'import time; x = bytearray(48 << 20); time.sleep(3); print(len(x))' &"

    async def go() -> tuple[str, int, int]:
        handle = await provider.create(task)
        cgroup = provider._sandboxes[handle.sandbox_id].cgroup
        assert cgroup is not None
        host_before = _host_available_mb()
        try:
            r = await provider.exec(handle, f"for i in $(seq 8); do {hog} done; wait",
                                    timeout_s=30)
            return r.output, cgroup.memory_peak_bytes(), host_before - _host_available_mb()
        finally:
            await provider.delete(handle)

    out, peak_bytes, host_drop_mb = asyncio.run(go())
    survivors = out.split().count(str(48 << 20))
    assert "Killed" in out and survivors < 8, out  # they could not all hold it at once
    assert peak_bytes <= MEMORY_MB << 20, f"the sandbox reached {peak_bytes >> 20} MiB"
    assert host_drop_mb < 8 * 48, f"host available memory fell by {host_drop_mb} MiB"


def test_without_cgroups_or_mounts_the_provider_warns_and_keeps_rlimits(
        task: Task, caplog: pytest.LogCaptureFixture) -> None:
    config = LocalProviderConfig(use_cgroups=False, tmpfs_per_sandbox=False)
    provider = LocalProvider(config)
    try:
        assert provider.caps == {"memory": "rlimits per process",
                                 "processes": "rlimits per process",
                                 "storage": "RLIMIT_FSIZE per file"}
    finally:
        asyncio.run(provider.close())
    with caplog.at_level(logging.WARNING, logger="services.sandbox.providers.local"):
        provider = LocalProvider(config.model_copy(update={"cgroup_parent": "nope",
                                                           "use_cgroups": True}))
        asyncio.run(provider.close())
    if provider.caps["memory"] == "rlimits per process":
        assert "capped per process only" in caplog.text
