"""`riptide dashboard`: a saved run served on a free port behind a fresh token."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.common import process
from services.testing.synthetic_events import SyntheticRun, write_jsonl


def test_serves_a_saved_run_and_prints_its_url(tmp_path: Path) -> None:
    events = write_jsonl(SyntheticRun(num_steps=3).generate(), tmp_path / "run.jsonl")
    log = tmp_path / "dashboard.log"
    proc = process.spawn([sys.executable, "-m", "services.cli", "dashboard", "--events",
                          str(events)], log_path=log)
    try:
        deadline, url = time.monotonic() + 60, ""
        while not url and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            url = next((line.split(" ", 1)[1] for line in log.read_text().splitlines()
                        if line.startswith("[dashboard] ")), "")
            time.sleep(0.2)
        page, _, fragment = url.partition("#token=")
        assert page.endswith("/dashboard") and len(fragment) >= 16
        api = page + "/api/summary"
        assert httpx.get(api).status_code == 401
        body = httpx.get(api, headers={"Authorization": f"Bearer {fragment}"}).json()
        assert [row["step"] for row in body["steps"]] == [1, 2, 3]
        assert httpx.get(page).status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) in (0, 130)  # 130: stopped by Ctrl-C, as `riptide up`
    finally:
        process.stop(proc)


def test_a_missing_export_is_a_precise_error(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "services.cli", "dashboard", "--events",
                             str(tmp_path / "none.jsonl")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "cannot read the events export" in result.stderr and "none.jsonl" in result.stderr


def test_without_a_source_it_says_which_to_give() -> None:
    result = subprocess.run([sys.executable, "-m", "services.cli", "dashboard"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--events FILE, --redis URL or --config FILE" in result.stderr
