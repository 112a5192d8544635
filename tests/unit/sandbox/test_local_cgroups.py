"""The cgroup layout and cap files local sandboxes write, for v2 (one directory per sandbox,
controllers delegated from the root down) and v1 (memory and pids hierarchies), on a scratch
directory standing in for the hierarchy; the real kernel is exercised by
tests/integration/test_local_sandbox_caps.py wherever the host has one."""

from __future__ import annotations

from pathlib import Path

from services.sandbox.providers.local_cgroups import CgroupHost


def test_v2_delegates_controllers_and_writes_the_caps(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    mounts = [(str(tmp_path / "elsewhere"), "cgroup", {"cpu"}), (str(tmp_path), "cgroup2", set())]
    host = CgroupHost._try_v2(mounts, "riptide/sandboxes", "123-abc")
    assert isinstance(host, CgroupHost) and host.kind == "v2"
    instance = tmp_path / "riptide" / "sandboxes" / "123-abc"
    assert host.bases == [instance]
    for level in (tmp_path, tmp_path / "riptide", tmp_path / "riptide" / "sandboxes", instance):
        assert (level / "cgroup.subtree_control").read_text() == "+memory +pids"
    group = host.create("sbx-1", memory_mb=64, max_processes=20)
    assert (instance / "sbx-1" / "memory.max").read_text() == str(64 << 20)
    assert (instance / "sbx-1" / "pids.max").read_text() == "20"
    assert group.enter_argv()[-1] == str(instance / "sbx-1" / "cgroup.procs")


def test_v2_without_the_memory_controller_is_no_candidate(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu hugetlb\n")
    found = CgroupHost._try_v2([(str(tmp_path), "cgroup2", set())], "riptide", "1-a")
    assert isinstance(found, str) and "memory and pids" in found


def test_v1_uses_the_memory_and_pids_hierarchies(tmp_path: Path) -> None:
    mounts = [(str(tmp_path / "memory"), "cgroup", {"rw", "memory"}),
              (str(tmp_path / "pids"), "cgroup", {"rw", "pids"})]
    host = CgroupHost._try_v1(mounts, "riptide", "1-a")
    assert isinstance(host, CgroupHost) and host.kind == "v1"
    group = host.create("sbx", memory_mb=128, max_processes=40)
    assert group.dirs == [tmp_path / "memory" / "riptide" / "1-a" / "sbx",
                          tmp_path / "pids" / "riptide" / "1-a" / "sbx"]
    assert (group.dirs[0] / "memory.limit_in_bytes").read_text() == str(128 << 20)
    assert (group.dirs[1] / "pids.max").read_text() == "40"
    assert not (group.dirs[0] / "memory.memsw.limit_in_bytes").exists()  # swap not accounted
    assert CgroupHost._try_v1(mounts[:1], "riptide", "1-a") == (
        "v1: no memory and pids hierarchies mounted")
