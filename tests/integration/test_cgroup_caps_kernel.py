"""The cgroup caps of local sandboxes against the kernel itself, without bubblewrap: whichever
hierarchy `CgroupHost.detect` finds on this host (v2 where it has the memory and pids
controllers, else v1), a process that joins a sandbox's cgroup through `enter_argv` is
OOM-killed past the memory cap and cannot fork past the process cap, what it leaves is killed
and the directories removed. A host without a writable hierarchy (or not root) skips; run on
a cgroup-v2 host, this is the v2 path's real test (tests/unit/sandbox/test_local_cgroups.py
checks only its layout)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from services.sandbox.providers.local_cgroups import CgroupHost

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="writing cgroups needs root")
MEMORY_MB, MAX_PROCESSES = 64, 12
_ALLOCATE = "b = bytearray({mb} << 20); b[::4096] = b'x' * len(b[::4096]); print('survived')"
# Children close the output pipe (so the run returns) and sleep on inside the cgroup.
_FORK = ("import os, time\nn = 0\ntry:\n    for _ in range(40):\n        if os.fork() == 0:\n"
         "            os.close(1); os.close(2); time.sleep(30); os._exit(0)\n        n += 1\n"
         "except OSError:\n    pass\nprint(n, flush=True)")


@pytest.fixture()
def host() -> Iterator[CgroupHost]:
    found, note = CgroupHost.detect("riptide-test", f"{os.getpid()}-{uuid.uuid4().hex[:6]}")
    if found is None:
        pytest.skip(f"no writable cgroup hierarchy: {note}")
    print(note)
    yield found
    found.close()


def _run(host: CgroupHost, code: str) -> tuple[subprocess.CompletedProcess[str], int, int]:
    group = host.create(f"sbx-{uuid.uuid4().hex[:6]}", MEMORY_MB, MAX_PROCESSES)
    try:
        done = subprocess.run([*group.enter_argv(), sys.executable, "-c", code],
                              capture_output=True, text=True, timeout=60)
        peak = group.memory_peak_bytes()
        left = len(group.pids())
    finally:
        group.remove()
    assert not any(d.exists() for d in group.dirs)
    return done, peak, left


def test_memory_past_the_cap_is_killed(host: CgroupHost) -> None:
    done, peak, _ = _run(host, _ALLOCATE.format(mb=4 * MEMORY_MB))
    assert done.returncode == -9 and "survived" not in done.stdout, (host.kind, done)
    assert peak <= (MEMORY_MB << 20) + (1 << 20), peak
    done, _, _ = _run(host, _ALLOCATE.format(mb=MEMORY_MB // 4))
    assert done.returncode == 0 and "survived" in done.stdout, done  # under the cap: fine


def test_forks_past_the_cap_fail_and_leftovers_are_killed(host: CgroupHost) -> None:
    done, _, left = _run(host, _FORK)
    assert done.returncode == 0, done
    forked = int(done.stdout.split()[0])
    assert forked < MAX_PROCESSES, (host.kind, forked)  # the parent counts too
    assert left >= forked  # its sleeping children were still in the cgroup, then killed
