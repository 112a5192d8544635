"""A trainer whose ranks the cluster launcher starts (`parallel.launcher = "external"`), as
srun does across nodes: two `riptide serve trainer` processes, one with torchrun's variables
and one with Slurm's, meet at MASTER_ADDR:MASTER_PORT and train data-parallel from the real
stream. Rank 0 serves and checkpoints; both replicas stay identical. A SIGTERM to every rank
(a cancelled job) ends with a final checkpoint and exit 0 everywhere; when rank 0 is killed,
the other rank leaves on its own instead of waiting forever; without the variables the
command fails with a message that names them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common import process
from services.common.buffer import SampleBuffer
from services.common.config import RedisConfig
from services.common.ports import free_ports
from services.testing.trainer_groups import scored_group
from services.trainer.weights.checkpoint import STATE_FILE, Checkpointer

NUM_STEPS = 2


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="riptide-launched-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _write_config(workdir: Path, redis_config: RedisConfig, model_dir: Path) -> Path:
    grpc_port, admin_port = free_ports(2)
    config = workdir / "deploy.toml"
    config.write_text(f"""
[run]
name = "launched"
admin_token = "launched-admin"
log_format = "text"
[redis]
url = "{redis_config.url}"
password = "{redis_config.password}"
[trainer]
grpc_port = {grpc_port}
admin_port = {admin_port}
rollout_batch_size = 2
read_block_ms = 200
max_tokens_per_microbatch = 24
[trainer.model]
hf_path = "{model_dir}"
dtype = "float32"
[trainer.optimizer]
lr = 1e-3
[trainer.parallel]
data_parallel = 2
launcher = "external"
[trainer.checkpoint]
dir = "{workdir / 'ckpt'}"
num_kept = 5
[trainer.weight_sync]
mode = "off"
""")
    return config


class Ranks:
    """Both ranks of one launch, started the way srun/torchrun would start them."""

    def __init__(self, workdir: Path, config: Path) -> None:
        self.workdir, self.config = workdir, config
        self.procs: list[subprocess.Popen[bytes]] = []
        self.launches = 0

    def start(self) -> None:
        self.launches += 1
        [port] = free_ports(1)
        master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        envs = [{"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
                {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}]
        cmd = [sys.executable, "-m", "services.cli", "serve", "trainer", "--config",
               str(self.config)]
        self.procs = [process.spawn(cmd, log_path=self.log(r), env={**os.environ, **master, **e})
                      for r, e in enumerate(envs)]

    def log(self, rank: int) -> Path:
        return self.workdir / f"launch{self.launches}-rank{rank}.log"

    def tails(self) -> str:
        return "\n".join(f"--- rank {r}\n{self.log(r).read_text()[-2000:]}" for r in range(2))

    def wait_for_step(self, step: int) -> None:
        deadline = time.monotonic() + 240
        while not Checkpointer(self.workdir / "ckpt").path(step).exists():
            assert all(p.poll() is None for p in self.procs), self.tails()
            assert time.monotonic() < deadline, f"no step {step}: {self.tails()}"
            time.sleep(0.1)

    def stop(self) -> None:
        for p in self.procs:
            process.stop(p, grace_s=2)


@pytest.mark.slow
def test_externally_launched_ranks_train_and_stop_together(
    redis_config: RedisConfig, workdir: Path
) -> None:
    from services.common.tiny_model import create_tiny_model

    model_dir = create_tiny_model(workdir / "model", hidden_size=64, num_layers=2)
    buffer = SampleBuffer(redis_config, "launched")
    for i in range(2 * NUM_STEPS):
        assert buffer.put(scored_group(i))
    ranks = Ranks(workdir, _write_config(workdir, redis_config, model_dir))
    try:
        ranks.start()
        ranks.wait_for_step(NUM_STEPS)
        for p in ranks.procs:  # what scancel does: every rank at once
            p.send_signal(signal.SIGTERM)
        assert [p.wait(60) for p in ranks.procs] == [0, 0], ranks.tails()
        assert "rank 1 stopping" in ranks.log(1).read_text()

        ckpt = Checkpointer(workdir / "ckpt")
        latest = ckpt.latest()
        assert latest is not None
        state = json.loads((latest / STATE_FILE).read_text())
        step = state["step"]
        assert step >= NUM_STEPS
        assert sorted(state["trained_group_ids"]) == [f"group-{i:03d}" for i in range(2 * step)]
        replicas = [torch.load(ckpt.path(step) / f"rank-{r:05d}" / "model.pt",
                               weights_only=False) for r in range(2)]
        initial = torch.load(ckpt.path(1) / "rank-00001" / "model.pt", weights_only=False)
        moved = False
        for key, value in replicas[0].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, replicas[1][key]), key  # DP replicas in lockstep
                moved |= not torch.equal(value, initial[key])
        assert moved  # and they trained past step 1

        # Rank 0 dies without a word: rank 1 must notice and leave, not wait for a command.
        ranks.start()
        deadline = time.monotonic() + 120
        while "ready" not in ranks.log(1).read_text():
            assert ranks.procs[1].poll() is None and time.monotonic() < deadline, ranks.tails()
            time.sleep(0.2)
        ranks.procs[0].kill()
        assert ranks.procs[1].wait(60) != 0, ranks.tails()
    finally:
        ranks.stop()


def test_missing_launcher_variables_are_a_clear_error(workdir: Path) -> None:
    nowhere = RedisConfig(url="redis://127.0.0.1:1/0", password="never-used-password")
    config = _write_config(workdir, nowhere, workdir / "no-model")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "SLURM_PROCID", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "trainer", "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "neither RANK nor SLURM_PROCID is set" in out.stderr
