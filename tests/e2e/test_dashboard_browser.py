"""The dashboard of a running local stack in headless Chromium: every panel fills with real
data, one sample opens, and a screenshot is saved as the test's artifact; then the finished
run reopens from the events it saved."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common import process
from services.common.config import dump_config
from services.local_stack import ensure_tiny_model, local_config
from services.rollout.dashboard.config import DashboardConfig
from services.rollout.dashboard.record import load_jsonl
from services.rollout.dashboard.summary import summary
from services.testing.chromium import Chromium, find_chromium

pytestmark = pytest.mark.slow

#: Panels that must show data from the run itself (data-points > 0 on the page).
PANELS = ("advisories", "timeline", "concurrency", "per_engine", "per_rank", "cache",
          "staleness", "step_time", "tokens_per_s", "reward", "evals", "engines", "sandboxes",
          "samples")
POINTS = ("Object.fromEntries([...document.querySelectorAll('[data-panel]')]"
          ".map(p => [p.dataset.panel, Number(p.dataset.points || 0)]))")


def _artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("RIPTIDE_TEST_ARTIFACTS") or tmp_path / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _dashboard_url(log: Path, up: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in (log.read_text() if log.exists() else "").splitlines():
            if line.startswith("[up] dashboard "):
                return line.removeprefix("[up] dashboard ").strip()
        assert up.poll() is None, f"riptide up exited:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no dashboard URL printed:\n{log.read_text()[-4000:]}")


def test_dashboard_of_a_running_stack_in_chromium(tmp_path: Path) -> None:
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium on PATH: `make test-deps` installs it (apt-get install chromium)")
    run_dir = tmp_path / "stack"
    run_dir.mkdir()
    ensure_tiny_model(run_dir)
    # Evaluate one held-out task at the start and after every step, so the eval panel fills.
    config = local_config(run_dir, {"rollout": {"eval": {"interval_steps": 1,
                                                         "task_ids": ["csv-revenue"]}}})
    config_path = run_dir / "config.toml"
    config_path.write_text(dump_config(config))
    os.chmod(config_path, 0o600)
    log = tmp_path / "up.log"
    up = process.spawn([sys.executable, "-m", "services.cli", "up", "--dir", str(run_dir),
                        "--config", str(config_path)], log_path=log)
    try:
        url = _dashboard_url(log, up, timeout_s=240)
        base, _, fragment = url.partition("#")
        assert fragment == f"token={config.run.admin_token}"
        api = base.removesuffix("/dashboard") + "/dashboard/api/summary"
        assert httpx.get(api).status_code == 401  # the data needs the token; the page does not
        with Chromium(chromium) as browser:
            browser.navigate(url)
            seen: dict[str, int] = {}
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                points = browser.evaluate(POINTS) or {}
                seen.update({k: max(v, seen.get(k, 0)) for k, v in points.items()})
                if all(seen.get(p, 0) > 0 for p in PANELS) and all(
                        points.get(p, 0) > 0 for p in PANELS if p != "sandboxes"):
                    break
                assert up.poll() is None, log.read_text()[-4000:]
                time.sleep(1.0)
            missing = [p for p in PANELS if seen.get(p, 0) == 0]
            error = browser.evaluate("document.getElementById('error').textContent")
            assert not missing, f"panels without data: {missing}; seen {seen}; error {error!r}"
            # Dropped groups: the local stack keeps zero-variance groups, so there may be none;
            # the panel then says so.
            dropped = browser.evaluate("document.getElementById('dropped').textContent")
            assert seen.get("dropped", 0) > 0 or "no group dropped" in dropped

            row = browser.wait_for("(r => r && (r.click(), r.dataset.sample))("
                                   "document.querySelector('#samples tr[data-sample]'))", 30)
            browser.wait_for("Number(document.querySelector('[data-panel=sample]')"
                             ".dataset.points) > 0", 30)
            sample = json.loads(browser.evaluate(
                "JSON.stringify({title: document.getElementById('sample-title').textContent,"
                " turns: document.querySelectorAll('#sample .turn').length,"
                " tokens: document.querySelectorAll('#sample .tok').length,"
                " trained: document.querySelectorAll('#sample .tok:not(.prompt)').length})"))
            assert sample["title"] == row and sample["turns"] >= 1
            assert sample["tokens"] > sample["trained"] > 0
            shot = browser.screenshot(_artifacts(tmp_path) / "dashboard.png")
        print(f"dashboard screenshot: {shot}")
        assert shot.stat().st_size > 10_000
        up.send_signal(signal.SIGINT)
        assert up.wait(120) in (0, 130)
    finally:
        process.stop(up)
    # The finished run reopens from the events `riptide up` saved as it stopped.
    saved = summary(load_jsonl(run_dir / "events.jsonl"), DashboardConfig(), live=False)
    assert saved["steps"] and saved["evals"] and saved["timeline"]["lanes"][0]["spans"]
    opened = [row for row in saved["samples"] if row["has_detail"]]
    assert opened, "no episode detail in the saved events"
