"""The CPU sampler the learning bench reports with: a process tree's cores busy and its
busiest thread, from two /proc snapshots."""

from __future__ import annotations

import subprocess
import sys
import time

from services.testing.cpu_sampler import CpuSnapshot, cpu_use, snapshot

_SPIN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def test_a_spinning_child_shows_as_its_parents_busiest_thread() -> None:
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {_SPIN!r}])\n"
                               "time.sleep(30)\n"])
    try:
        time.sleep(0.5)  # the spinning grandchild exists
        before = snapshot({"busy": parent.pid, "idle": idle.pid})
        time.sleep(1.5)
        use = cpu_use(before, snapshot({"busy": parent.pid, "idle": idle.pid}))
    finally:
        for proc in (parent, idle):
            proc.kill()
            proc.wait()
    assert use["busy"]["busiest_thread"] == "python" or "python" in str(
        use["busy"]["busiest_thread"])
    assert float(use["busy"]["busiest_thread_share"]) > 0.3  # two shared cores, noisy
    assert float(use["busy"]["cores"]) >= float(use["busy"]["busiest_thread_share"])
    assert float(use["idle"]["cores"]) < 0.1


def test_threads_born_in_between_count_from_zero_and_gone_services_are_empty() -> None:
    before = CpuSnapshot(at=0.0, threads={"a": {(1, 1): ("loop", 2.0)}})
    after = CpuSnapshot(at=10.0, threads={"a": {(1, 1): ("loop", 7.0), (1, 2): ("new", 1.0)},
                                          "b": {}})
    use = cpu_use(before, after)
    assert use["a"] == {"cores": 0.6, "busiest_thread": "loop", "busiest_thread_share": 0.5}
    assert use["b"] == {"cores": 0.0, "busiest_thread": "", "busiest_thread_share": 0.0}
