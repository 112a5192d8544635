"""`riptide up`: Redis and four real service processes, health, auth, and a clean Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import process
from services.deployment import load_config
from services.testing.proc_tree import alive, descendants

pytestmark = pytest.mark.slow
SERVICES = ("router", "rollout", "sandbox", "trainer")


def _wait_for_line(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if needle in text:
            return
        assert proc.poll() is None, f"riptide up exited early:\n{text[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {needle!r} within {timeout_s}s:\n{log.read_text()[-4000:]}")


def test_up_serves_all_services_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "stack"
    log = tmp_path / "up.log"
    up = process.spawn(
        [sys.executable, "-m", "services.cli", "up", "--dir", str(run_dir)], log_path=log
    )
    try:
        _wait_for_line(log, "all services ready", up, timeout_s=240)
        config = load_config(run_dir / "config.toml")
        children = descendants(up.pid)
        assert len(children) >= 5, "expected redis and four services as children"

        token = {"Authorization": f"Bearer {config.run.admin_token}"}
        for name in SERVICES:
            section = getattr(config, name)
            with grpc.insecure_channel(section.grpc_address) as channel:
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=5
                )
            assert health.status == health_pb2.HealthCheckResponse.SERVING, name
            assert httpx.get(f"{section.admin_url}/readyz").status_code == 200, name
            assert httpx.get(f"{section.admin_url}/admin/state").status_code == 401, name
            state = httpx.get(f"{section.admin_url}/admin/state", headers=token)
            assert state.status_code == 200 and state.json()["service"] == name
        _engines_need_their_key(config, token, up.pid)

        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "status",
                "--config",
                str(run_dir / "config.toml"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        for name in SERVICES:
            assert name in status.stdout

        up.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the foreground process
        assert up.wait(120) in (0, 130)
        time.sleep(0.5)
        assert alive(children) == set(), "processes left behind after Ctrl-C"
        assert "[up] stopped" in log.read_text()
    finally:
        process.stop(up)


#: Starts `riptide up` with SIGINT ignored, as a shell starts a background job (`riptide up &`):
#: an ignored signal stays ignored across exec.
_AS_BACKGROUND_JOB = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                      "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def test_up_started_with_sigint_ignored_still_stops_on_it(tmp_path: Path) -> None:
    log = tmp_path / "up.log"
    up = process.spawn([sys.executable, "-c", _AS_BACKGROUND_JOB, "-m", "services.cli", "up",
                        "--dir", str(tmp_path / "stack")], log_path=log)
    try:
        _wait_for_line(log, "all services ready", up, timeout_s=240)
        status = Path(f"/proc/{up.pid}/status").read_text()
        ignored = int(next(line for line in status.splitlines()
                           if line.startswith("SigIgn:")).split()[1], 16)
        assert not ignored & (1 << (signal.SIGINT - 1)), "riptide up left SIGINT ignored"
        children = descendants(up.pid)
        up.send_signal(signal.SIGINT)
        assert up.wait(120) == 130
        time.sleep(0.5)
        assert alive(children) == set(), "processes left behind after SIGINT"
        assert "[up] stopping" in log.read_text() and "[up] stopped" in log.read_text()
    finally:
        process.stop(up)


def _engines_need_their_key(config: object, token: dict[str, str], up_pid: int) -> None:
    """The fleet's engine answers only the stack's generated key (SGLang's 401 otherwise),
    and no process has it, or any other secret, on its command line."""
    run = config.run  # type: ignore[attr-defined]
    state = httpx.get(f"{config.rollout.admin_url}/admin/state",  # type: ignore[attr-defined]
                      headers=token).json()
    url = state["details"]["engines"][0]["url"]
    refused = httpx.get(f"{url}/model_info", timeout=10)
    assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
    key = {"Authorization": f"Bearer {run.engine_api_key}"}
    assert httpx.get(f"{url}/model_info", headers=key, timeout=10).status_code == 200
    for pid in descendants(up_pid) | {up_pid}:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        for secret in (run.engine_api_key, run.grpc_token, run.admin_token):
            assert secret not in argv, f"a secret on the command line of pid {pid}"


def test_up_without_redis_says_how_to_install_it(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path / "empty-bin"), "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--dir", str(tmp_path / "stack")],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=60,
    )
    assert result.returncode == 2
    assert "redis-server is not on PATH" in result.stderr
    assert "apt-get install -y redis-server" in result.stderr


def test_up_with_steps_trains_syncs_and_summarizes(tmp_path: Path) -> None:
    """The demo path: episodes flow, the trainer steps and syncs weights, then all stops;
    with `[run.tracking]`, its metrics are exported live to TensorBoard as it goes."""
    import json

    from services.common.config import dump_config
    from services.local_stack import ensure_tiny_model, local_config

    run_dir, tensorboard_dir = tmp_path / "stack", tmp_path / "tb"
    ensure_tiny_model(run_dir)
    config_path = tmp_path / "tracked.toml"
    config_path.write_text(dump_config(local_config(
        run_dir, {"run": {"tracking": {"tensorboard_dir": str(tensorboard_dir)}}})))
    log = tmp_path / "up.log"
    up = process.spawn([sys.executable, "-m", "services.cli", "up", "--dir", str(run_dir),
                        "--config", str(config_path), "--steps", "2"], log_path=log)
    try:
        _wait_for_line(log, "all services ready", up, timeout_s=240)
        children = descendants(up.pid)
        assert up.wait(300) == 0, log.read_text()[-4000:]
    finally:
        process.stop(up)
    summary_line = next(line for line in log.read_text().splitlines()
                        if line.startswith('{"riptide_up_summary"'))
    summary = json.loads(summary_line)["riptide_up_summary"]
    # The counts match the disk: 2 steps trained, checkpointed and synced, none beyond.
    assert summary["steps"] == summary["checkpoint_step"] == 2
    assert summary["weight_version"] == 2
    assert summary["groups_trained"] == 4  # rollout_batch_size 2 per step
    assert _checkpoint_steps(run_dir)[-1] == 2
    # Engine and trainer log-probs agree after each sync (same weights on both sides).
    assert summary["mismatch_kl_last_step"] < 1e-3
    assert summary["prefix_cache_hit_rate"] > 0.5
    time.sleep(0.5)
    assert alive(children) == set(), "processes left behind after the run ended"
    steps = _check_progress_and_events(log.read_text(), run_dir / "events.jsonl")
    assert steps == [1, 2]
    _check_tensorboard(tensorboard_dir, steps)


def _checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").iterdir()
                  if p.name.startswith("step-"))


def _check_tensorboard(logdir: Path, steps: list[int]) -> None:
    pytest.importorskip("tensorboard", reason="the tracking extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    assert [p.step for p in accumulator.Scalars("train/loss")] == steps  # one per line
    assert {"train/reward_mean", "train/tokens_per_s",
            "rollout/cache_hit_rate"} <= set(accumulator.Tags()["scalars"])


#: What a two-step local run publishes (dropped groups and evaluations: unit tests).
RUN_KINDS = {"trainer.step", "trainer.wait_data", "trainer.checkpoint", "trainer.weight_sync",
             "trainer.weight_sync.bucket", "rollout.engine_pause", "rollout.episode",
             "rollout.load", "sandbox.create", "sandbox.delete", "sandbox.verify", "sandbox.live"}


def _check_progress_and_events(text: str, saved: Path) -> list[int]:
    """One progress line per step, and the run's events saved at the end, each kind there;
    returns the steps of the progress lines."""
    from services.common.events import load_episodes, load_events

    lines = [line for line in text.splitlines() if line.startswith("[step ")]
    steps = [int(line.split("]")[0].removeprefix("[step ")) for line in lines]
    assert steps[:2] == [1, 2] and steps == list(range(1, len(steps) + 1)), text[-3000:]
    assert all("idle " in line and "cache hit " in line and "staleness " in line
               for line in lines)
    assert "ETA " in lines[1]
    events = load_events(saved)
    assert RUN_KINDS <= {e.kind for e in events}, sorted({e.kind for e in events})
    # The events count what the progress lines count: no step or sync after the last one.
    assert [e.attrs["step"] for e in events if e.kind == "trainer.step"] == steps
    assert max(int(e.id) for e in events if e.kind == "trainer.weight_sync") == steps[-1]
    loads = [e for e in events if e.kind == "rollout.load" and e.attrs["engines"]]
    assert any(r["cached_tokens"] > 0 for e in loads for r in e.attrs["engines"])
    episode = next(e for e in events if e.kind == "rollout.episode")
    assert episode.attrs["engine"].startswith("http://") and episode.attrs["turns"] >= 1
    snapshots = [e.attrs["sandboxes"] for e in events if e.kind == "sandbox.live"]
    assert any(row["state"] == "running" and row["provider"] == "local" and row["sandbox"]
               and row["sample_id"] and row["task_id"] for rows in snapshots for row in rows)
    assert snapshots[-1] == []  # the sandbox service's last word: nothing left alive
    waits = [e.attrs["warmup"] for e in events if e.kind == "trainer.wait_data"]
    assert waits == [True] + [False] * (len(waits) - 1)  # engines start in the first wait
    step = next(e for e in events if e.kind == "trainer.step")
    assert len(step.attrs["staleness"]) == step.attrs["samples"] > 0
    detail = load_episodes(saved)[0]
    assert detail["turns"] and detail["turns"][0]["assistant"]
    assert len(detail["token_text"]) == len(detail["tokens"]["ids"])
    assert len(detail["tokens"]["loss_mask"]) == len(detail["tokens"]["ids"])
    return steps


def test_a_service_failing_at_start_stops_the_stack_with_its_error(tmp_path: Path) -> None:
    """A trainer that cannot load its model fails `riptide up` fast, naming the cause."""
    from services.common.config import dump_config
    from services.local_stack import ensure_tiny_model, local_config

    run_dir = tmp_path / "stack"
    ensure_tiny_model(run_dir)
    config = local_config(run_dir, {"trainer": {"model": {"hf_path": str(tmp_path / "absent")}}})
    config_path = tmp_path / "broken.toml"
    config_path.write_text(dump_config(config))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "services.cli", "up", "--dir", str(run_dir),
                             "--config", str(config_path)], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "trainer failed while starting" in result.stderr
    assert str(tmp_path / "absent") in result.stderr
    assert time.monotonic() - started < 120
    assert "[up] stopped" in result.stdout


def _up_steps(run_dir: Path, steps: int, log: Path) -> str:
    up = process.spawn([sys.executable, "-m", "services.cli", "up", "--dir", str(run_dir),
                        "--steps", str(steps)], log_path=log)
    try:
        assert up.wait(420) == 0, log.read_text()[-4000:]
    finally:
        process.stop(up)
    return log.read_text()


def test_up_twice_in_one_dir_resumes_the_run(tmp_path: Path) -> None:
    """What `make demo` twice does: the second run resumes from the first one's checkpoint and
    stream (the trainer's first sync goes to a rollout service not up yet) and says so."""
    import json

    run_dir = tmp_path / "stack"
    first = _up_steps(run_dir, 1, tmp_path / "up1.log")
    assert "[up] starting a fresh run" in first
    second = _up_steps(run_dir, 1, tmp_path / "up2.log")
    resumed = next(line for line in second.splitlines() if "[up] resuming the run" in line)
    step = int(resumed.split("checkpoint at step ")[1].split()[0])
    assert step >= 1
    summary = json.loads(next(line for line in second.splitlines()
                              if line.startswith('{"riptide_up_summary"')))["riptide_up_summary"]
    assert summary["steps"] == summary["checkpoint_step"] == step + 1
    assert _checkpoint_steps(run_dir)[-1] == step + 1
    assert summary["weight_version"] > step  # the resume pushed a version never used before
    assert "died" not in second  # nothing crashed on the way
