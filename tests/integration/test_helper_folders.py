"""The test helpers that start servers as child processes leave nothing behind: a stopped
simulated engine's or router's folder (its ready file, config and log) is gone, and a server
that fails to start still reports its log's tail."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from services.common.errors import Unavailable
from services.testing.child_server import ChildServer
from services.testing.router_process import RouterProcess
from services.testing.sim_engine_process import SimEngineProcess


def test_stopped_servers_remove_their_folders() -> None:
    with SimEngineProcess() as engine, RouterProcess() as router:
        folders = [engine._dir, router._dir]
        assert all(folder.is_dir() for folder in folders)
        assert "router.log" in {p.name for p in router._dir.iterdir()}
    assert not any(folder.exists() for folder in folders)


def test_a_failed_start_reports_the_log_and_removes_the_folder() -> None:
    class Failing(ChildServer):
        name = "failing"

    def folders() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("riptide-failing-*"))

    before = folders()
    cmd = [sys.executable, "-c", "import sys; print('no port for you'); sys.exit(3)"]
    with pytest.raises(Unavailable, match="no port for you"):
        Failing(cmd, start_timeout_s=30)
    assert folders() == before  # the failed server's folder went with its stop
