"""docker-compose.yaml for real: both images built offline, the stack up under podman, trainer
steps and weight syncs read through the admin endpoints, then `down` leaves nothing."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.ports import free_ports
from services.testing.podman_compose import PodmanCompose, podman, podman_env

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
# Stable tags: they are the build cache between runs (podman keeps their layers).
BASE_IMAGE = "localhost/riptide-base:bookworm"
IMAGE = "localhost/riptide-compose-test:latest"
STEPS = 3
SERVICES = ("router", "rollout", "sandbox", "trainer")


def _require_podman() -> None:
    missing = [p for p in ("podman", "debootstrap", "docker-compose") if not shutil.which(p)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed and not installable here "
                    "(`make test-deps` installs them with apt as root)")
    if os.geteuid() != 0:
        pytest.skip("debootstrap and rootful podman need root")


def _image_id(env: dict[str, str], tag: str) -> str | None:
    try:
        return podman(env, "image", "inspect", "--format", "{{.Id}}", tag).strip()
    except RuntimeError:
        return None


def _script(name: str, tag: str, env: dict[str, str], log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run([str(REPO / "scripts" / name), tag], cwd=REPO, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=1200)
    assert done.returncode == 0, f"{name} failed:\n{log.read_text()[-4000:]}"


def _build_images(env: dict[str, str], logs: Path) -> None:
    """The base from debootstrap (kept while its package list holds), then Riptide's image
    from wheels with `--network none`; the image it replaces is removed."""
    build_env = {**env, "ENGINE": "podman", "BASE_IMAGE": BASE_IMAGE, "EXTRAS": "",
                 "PYTHON": sys.executable}
    _script("build_base_image.sh", BASE_IMAGE, build_env, logs / "base.log")
    old = _image_id(env, IMAGE)
    _script("build_image.sh", IMAGE, build_env, logs / "image.log")
    new = _image_id(env, IMAGE)
    if old and old != new:
        subprocess.run(["podman", "rmi", old], env=env, capture_output=True)


def _state(port: int, token: str) -> dict[str, Any]:
    resp = httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=5.0,
                     headers={"Authorization": f"Bearer {token}"})
    resp.raise_for_status()
    return dict(resp.json())


def _wait_for_training(ports: dict[str, int], token: str, timeout_s: float) -> dict[str, Any]:
    """Poll until the trainer finished STEPS steps and every engine holds that version."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            trainer = _state(ports["trainer"], token)["details"]
            rollout = _state(ports["rollout"], token)["details"]
        except httpx.HTTPError as exc:
            last = {"error": str(exc)}
        else:
            last = {"trainer": trainer, "rollout": rollout}
            versions = [e.get("weight_version") or 0 for e in rollout.get("engines", [])]
            if trainer.get("step", 0) >= STEPS and versions and min(versions) >= STEPS:
                return last
        time.sleep(3.0)
    raise AssertionError(f"no {STEPS} steps and weight syncs in {timeout_s:.0f}s: {last}")


@pytest.mark.timeout(2400)
def test_compose_stack_trains_under_podman(tmp_path: Path) -> None:
    _require_podman()
    _build_images(podman_env(tmp_path), tmp_path)
    token = secrets.token_urlsafe(16)
    ports = dict(zip(SERVICES, free_ports(len(SERVICES)), strict=True))
    # Every secret on: gRPC token, engine key and the Redis password, all from the environment.
    secret_env = {name: secrets.token_urlsafe(24) for name in (
        "RIPTIDE_GRPC_TOKEN", "RIPTIDE_ENGINE_API_KEY", "RIPTIDE_REDIS_PASSWORD")}
    compose_env = {"RIPTIDE_IMAGE": IMAGE, "RIPTIDE_ADMIN_TOKEN": token, **secret_env,
                   **{f"RIPTIDE_{name.upper()}_PORT": str(p) for name, p in ports.items()}}
    stack = PodmanCompose(REPO, tmp_path, f"riptide-test-{os.getpid()}", compose_env)
    stack.start_api()
    try:
        try:
            stack.up()
            state = _wait_for_training(ports, token, timeout_s=900)
            for name, port in ports.items():  # published on loopback, readiness open
                assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200, name
            # podman exec, not `docker-compose exec`: an exec session made through podman's
            # Docker API keeps its conmon for 5 minutes after it ended (--exit-delay 300).
            trainer_id = stack.compose("ps", "-q", "trainer").stdout.strip()
            status = subprocess.run(
                ["podman", "exec", trainer_id, "riptide", "status", "--config",
                 "/etc/riptide/config.toml", "--set", f"run.admin_token={token}"],
                env=stack.env, capture_output=True, text=True, timeout=120)
            trainer_log = stack.logs("trainer")
            # Inside the compose network, Redis wants the login: NOAUTH without it.
            redis_id = stack.compose("ps", "-q", "redis").stdout.strip()
            anonymous = subprocess.run(["podman", "exec", redis_id, "redis-cli", "ping"],
                                       env=stack.env, capture_output=True, text=True,
                                       timeout=120)
        except Exception as exc:
            raise AssertionError(f"{exc}\n--- compose logs ---\n{stack.logs()[-8000:]}") from exc
    finally:
        down = stack.down()
    assert state["trainer"]["num_groups_trained"] >= STEPS * 2
    recent = state["rollout"]["weight_updates"]["recent"]
    assert sum(u["status"] == "committed" for u in recent) >= STEPS, recent
    assert status.returncode == 0, status.stdout + status.stderr
    for name in SERVICES:
        assert any(line.split()[:2] == [name, "ready"] for line in status.stdout.splitlines()), \
            status.stdout
    assert "weight sync v" in trainer_log
    assert "NOAUTH" in anonymous.stdout + anonymous.stderr, anonymous
    assert stack.leftovers() == [], down
