"""The Slurm deployment on a real single-node Slurm cluster (munged, slurmctld, slurmd).

The site adapter is submitted with sbatch and runs the recipe's `train --smoke`: Redis, the
built-in engine, router, sandbox, trainer and rollout, each its own srun step, on loopback.
The trainer's step is SIGKILLed; the supervisor restarts it and it resumes from its
checkpoint; then the job is cancelled and no process of it is left. Every group the rollout
wrote is trained (in the last checkpoint) or still in the stream: nothing was lost. The
recipe's `eval --smoke` scores the smoke model with the same steps minus Redis and trainer,
and the job ends by itself with the result in the run directory.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from services.common import process
from services.common.ports import free_port
from services.deployment import load_config
from services.testing.slurm_cluster import SlurmCluster, missing_programs
from services.trainer.weights.checkpoint import Checkpointer

# 1-3 minutes on two idle cores: Slurm, six services, two steps, a trainer restart, a step.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]
REPO = Path(__file__).resolve().parents[2]
ADAPTER = REPO / "examples" / "glm52_tbench2" / "launch_16node_slurm.sh"


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="riptide-slurm-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _wait(probe: Callable[[], bool], what: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            texts = [f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in [log, *sorted(log.parent.glob("run/logs/*.log"))] if p.exists()]
            raise AssertionError(f"{what} not within {timeout_s}s:\n" + "\n".join(texts))
        time.sleep(1.0)


def _trainer_state(config: object) -> dict:
    headers = {"Authorization": f"Bearer {config.run.admin_token}"}  # type: ignore[attr-defined]
    try:
        url = f"{config.trainer.admin_url}/admin/state"  # type: ignore[attr-defined]
        return httpx.get(url, headers=headers, timeout=2.0).json().get("details") or {}
    except (httpx.HTTPError, ValueError):
        return {}


def _port_base(cluster: SlurmCluster) -> int:
    """A base with 12 free consecutive loopback ports, none the cluster's: an srun takes ports
    of SrunPortRange while its step runs, so a service started later could find its own taken
    (the trainer's gRPC port once was, 2026-12-07)."""
    taken = set(cluster.ports)
    for _ in range(50):
        base = random.randrange(20000, 30000)
        ports = range(base, base + 12)
        if taken.isdisjoint(ports) and all(free_port_is(port) for port in ports):
            return base
    raise RuntimeError("no run of 12 free ports")


def free_port_is(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def _stream_check(out: Path, config: object) -> tuple[set[str], set[str], list[str]]:
    """Reopen the run's Redis from its append-only file: produced, still-streamed, trained."""
    port = free_port()
    server = process.spawn(["redis-server", "--bind", "127.0.0.1", "--port", str(port),
                            "--dir", str(out / "redis"), "--appendonly", "yes", "--save", ""],
                           log_path=out / "check-redis.log")
    try:
        client = redis.Redis(port=port)
        _wait(lambda: _pings(client), "redis on the job's AOF", 30, out / "check-redis.log")
        run = config.run.name  # type: ignore[attr-defined]
        prefix = f"riptide:{run}:group:"
        produced = {k.decode()[len(prefix):] for k in client.scan_iter(f"{prefix}*")}
        streamed = set()
        for _, fields in client.xrange(f"riptide:{run}:samples"):
            streamed.add(fields.get(b"group_id", b"").decode())
        client.close()
    finally:
        process.stop(server)
    latest = Checkpointer(config.trainer.checkpoint.dir).latest()  # type: ignore[attr-defined]
    import json

    trained = json.loads((latest / "trainer_state.json").read_text())["trained_group_ids"]
    return produced, streamed, trained


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_smoke_run_on_slurm_restarts_a_killed_step_and_cancel_leaves_nothing(
        workdir: Path) -> None:
    missing = missing_programs()
    if missing:
        pytest.skip(f"a Slurm cluster needs {', '.join(missing)}; `make test-deps` installs "
                    "slurm-wlm and munge as root")
    out = workdir / "run"
    job_out = workdir / "job.out"
    with SlurmCluster(workdir / "cluster") as cluster:
        env = {**cluster.env(), "RIPTIDE_PYTHON": sys.executable,
               "RIPTIDE_HEAD_ADDRESS": "127.0.0.1", "PYTHONPATH": str(REPO)}
        submit = [ "sbatch", "--parsable", "--nodes=1", f"--chdir={workdir}",
                  f"--output={job_out}", str(ADAPTER), "train", "--smoke", "--steps", "50",
                  "--port-base", str(_port_base(cluster)), "--output-dir", str(out)]
        import subprocess

        job = subprocess.run(submit, env=env, capture_output=True, text=True, check=True,
                             timeout=30).stdout.strip()
        _wait(lambda: (out / "deploy.toml").exists(), "the recipe's config", 60, job_out)
        config = load_config(out / "deploy.toml")
        _wait(lambda: _trainer_state(config).get("step", 0) >= 2, "two trainer steps", 240,
              job_out)

        steps = cluster.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"]).stdout.split("\n")
        names = dict(reversed(line.split()) for line in steps if line.strip())
        assert {"redis", "engine-0", "router", "sandbox", "trainer", "rollout"} <= set(names), steps
        before = _trainer_state(config)["step"]
        cluster.run(["scancel", "--signal=KILL", names["trainer"]])
        _wait(lambda: "trainer exited with" in job_out.read_text(), "the kill seen", 60, job_out)
        _wait(lambda: _trainer_state(config).get("step", 0) > before, "a step after restart",
              180, job_out)
        state = _trainer_state(config)
        assert state["recovery"] is not None  # the new trainer resumed from its checkpoint
        assert "restart 1 of" in job_out.read_text()
        new_steps = cluster.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"]).stdout
        assert names["trainer"] not in new_steps and " trainer" in new_steps  # a new step

        cluster.run(["scancel", job])
        _wait(lambda: not cluster.run(["squeue", "-h", "-j", job]).stdout.strip(),
              "the job to end", 60, job_out)
        _wait(lambda: not _processes_mentioning(str(out)), "every step's processes to exit",
              30, job_out)

    produced, streamed, trained = _stream_check(out, config)
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(trained) >= 2 * (before + 1)  # rollout_batch_size 2 per step
    assert produced, "the rollout wrote no group"
    lost = produced - set(trained) - streamed
    assert not lost, f"groups neither trained nor in the stream: {sorted(lost)}"


def test_smoke_eval_on_slurm_scores_and_ends_by_itself(workdir: Path) -> None:
    missing = missing_programs()
    if missing:
        pytest.skip(f"a Slurm cluster needs {', '.join(missing)}; `make test-deps` installs "
                    "slurm-wlm and munge as root")
    import json
    import subprocess

    out = workdir / "run"
    job_out = workdir / "job.out"
    with SlurmCluster(workdir / "cluster") as cluster:
        env = {**cluster.env(), "RIPTIDE_PYTHON": sys.executable,
               "RIPTIDE_HEAD_ADDRESS": "127.0.0.1", "PYTHONPATH": str(REPO)}
        submit = ["sbatch", "--parsable", "--nodes=1", f"--chdir={workdir}",
                  f"--output={job_out}", str(ADAPTER), "eval", "--smoke",
                  "--port-base", str(_port_base(cluster)), "--output-dir", str(out)]
        job = subprocess.run(submit, env=env, capture_output=True, text=True, check=True,
                             timeout=30).stdout.strip()
        _wait(lambda: not cluster.run(["squeue", "-h", "-j", job]).stdout.strip(),
              "the eval job to end by itself", 300, job_out)
        _wait(lambda: not _processes_mentioning(str(out)), "every step's processes to exit",
              30, job_out)
    text = job_out.read_text()
    assert "[slurm] scoring done" in text, text[-3000:]
    assert "start redis" not in text and "start trainer" not in text
    result = json.loads((out / "eval" / "model" / "result.json").read_text())
    assert result["num_tasks"] == 2 and result["done"] == result["expected"] == 4
    assert all(len(e["rewards"]) == 2 for e in result["tasks"].values())
    assert '"mean_success"' in text  # the recipe printed it
