"""docker-compose.yaml run for real under podman: its Docker API socket, healthchecks, cleanup.

`PodmanCompose` starts `podman system service` on a socket of its own (with a
containers.conf that clears podman's default ulimits, which runc cannot set here), points
`docker-compose` at it, and after `down` lists whatever the project left behind: containers,
pods, volumes, networks, and any process that still names one of its containers.

Podman schedules healthchecks with systemd timers; where systemd is not PID 1 (CI
containers) nothing runs them and `condition: service_healthy` never holds. The
`HealthTicker` runs `podman healthcheck run` for the project's containers at the compose
file's interval, as the timers would: the checks themselves are the compose file's own.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import httpx

from services.common import process

PROJECT_LABEL = "com.docker.compose.project"


def podman_env(work_dir: Path) -> dict[str, str]:
    """The environment for podman commands: a containers.conf without default ulimits."""
    work_dir.mkdir(parents=True, exist_ok=True)
    conf = work_dir / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(env: dict[str, str], *args: str, timeout_s: float = 120.0) -> str:
    """Run one podman command and return its stdout; raise with stderr when it fails."""
    done = subprocess.run(["podman", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return done.stdout


class HealthTicker(threading.Thread):
    """Runs the project's containers' healthchecks every `interval_s` until stopped."""

    def __init__(self, env: dict[str, str], project: str, interval_s: float = 5.0) -> None:
        super().__init__(name=f"health-{project}", daemon=True)
        self.env, self.project, self.interval_s = env, project, interval_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                ids = podman(self.env, "ps", "-q", "--filter",
                             f"label={PROJECT_LABEL}={self.project}").split()
                for cid in ids:
                    if self._stop_event.is_set():
                        break
                    subprocess.run(["podman", "healthcheck", "run", cid], env=self.env,
                                   capture_output=True, timeout=60)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass  # a container went away between ps and the check; the next round sees
            self._stop_event.wait(self.interval_s)

    def stop(self) -> None:
        """Stop and wait for an in-flight check: an exec racing `down` leaves a conmon."""
        self._stop_event.set()
        self.join(90)


class PodmanCompose:
    """One compose project on its own podman API socket."""

    def __init__(self, repo: Path, work_dir: Path, project: str,
                 compose_env: dict[str, str]) -> None:
        self.repo, self.work_dir, self.project = repo, work_dir, project
        self.env = podman_env(work_dir)
        self.socket = work_dir / "podman.sock"
        self.compose_env = {**self.env, **compose_env, "DOCKER_HOST": f"unix://{self.socket}"}
        self.service: subprocess.Popen[bytes] | None = None
        self.ticker = HealthTicker(self.env, project)
        self.container_ids: set[str] = set()

    def start_api(self, timeout_s: float = 60.0) -> None:
        """Start `podman system service` on the project's socket and wait until it answers."""
        self.socket.unlink(missing_ok=True)
        self.service = process.spawn(
            ["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
            log_path=self.work_dir / "podman-service.log", env=self.env)
        transport = httpx.HTTPTransport(uds=str(self.socket))
        deadline = time.monotonic() + timeout_s
        with httpx.Client(transport=transport, timeout=2.0) as client:
            while time.monotonic() < deadline:
                try:
                    if client.get("http://podman/_ping").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if self.service.poll() is not None:
                    break
                time.sleep(0.3)
        raise RuntimeError(f"podman system service did not answer on {self.socket}")

    def compose(self, *args: str, timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
        """Run `docker-compose -p PROJECT ARGS` in the repository against podman."""
        return subprocess.run(["docker-compose", "-p", self.project, *args], cwd=self.repo,
                              env=self.compose_env, capture_output=True, text=True,
                              timeout=timeout_s)

    def up(self, timeout_s: float = 600.0) -> None:
        """`up -d` with healthchecks ticking; remember the containers it made."""
        self.ticker.start()
        done = self.compose("up", "-d", "--no-build", timeout_s=timeout_s)
        self.container_ids |= set(self._ids("ps", "-a", "-q", "--no-trunc"))
        if done.returncode != 0:
            raise RuntimeError(f"docker-compose up failed:\n{done.stdout}\n{done.stderr}")

    def logs(self, service: str = "") -> str:
        """`docker-compose logs` of one service or all (stdout and stderr)."""
        done = self.compose("logs", "--no-color", *([service] if service else []),
                            timeout_s=120)
        return done.stdout + done.stderr

    def down(self) -> str:
        """Stop the ticker, then `down -v`, then the API service; return compose's output."""
        self.ticker.stop()
        self.container_ids |= set(self._ids("ps", "-a", "-q", "--no-trunc"))
        done = self.compose("down", "-v", "--remove-orphans", "--timeout", "30",
                            timeout_s=300)
        if self.service is not None:
            process.stop(self.service)
        return done.stdout + done.stderr

    def leftovers(self) -> list[str]:
        """What the project left: containers, pods, volumes, networks, processes."""
        found = []
        label = f"label={PROJECT_LABEL}={self.project}"
        for kind, args in (("container", ("ps", "-a", "-q", "--filter", label)),
                           ("pod", ("pod", "ps", "-q", "--filter", f"name={self.project}")),
                           ("volume", ("volume", "ls", "-q", "--filter", label)),
                           ("network", ("network", "ls", "-q", "--filter", label))):
            found += [f"{kind} {name}" for name in podman(self.env, *args).split()]
        found += [f"process {pid}: {cmd}" for pid, cmd in self._processes()]
        if self.service is not None and self.service.poll() is None:
            found.append(f"podman system service (pid {self.service.pid})")
        return found

    def _ids(self, *args: str) -> list[str]:
        return podman(self.env, *args, "--filter", f"label={PROJECT_LABEL}={self.project}").split()

    def _processes(self) -> list[tuple[int, str]]:
        """Processes whose command line or cgroup names one of the project's containers."""
        hits = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                cgroup = (entry / "cgroup").read_text()
            except OSError:
                continue
            if any(cid in cmdline or cid in cgroup for cid in self.container_ids):
                hits.append((int(entry.name), cmdline[:200]))
        return hits
