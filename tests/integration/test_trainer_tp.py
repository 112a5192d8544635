"""`riptide serve trainer` with tensor_parallel=2, data_parallel=2, context_parallel=2 and
pipeline_parallel=2: two ranks each (rank 0 plus one worker process) train from the real
stream and end with the same parameters and step metrics as a one-rank trainer fed the same
batches from the same initial weights, also after a restart from the sharded checkpoint (TP);
SIGTERM leaves no process behind. With weight_sync mode "direct", a TP=2 trainer pushes its
weights to a real engine after every step."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.common import process
from services.common.buffer import SampleBuffer
from services.common.config import RedisConfig
from services.common.ports import free_ports
from services.testing.proc_tree import alive, descendants
from services.testing.trainer_groups import scored_group
from services.trainer.weights.checkpoint import STATE_FILE, Checkpointer

ADMIN = "admin-token-tp"
NUM_STEPS = 3


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="riptide-trainer-tp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Adam turns a gradient near 0 into a step of up to lr whose sign follows rounding noise
# (TP sums in another order); eps = 1e-6 keeps that noise well under the 1e-5 tolerance while
# real gradients (~1e-3 here) still take full steps.
def _config(
    workdir: Path, redis_config: RedisConfig, model_dir: Path, run: str, tp: int, dp: int,
    lr: float = 1e-4, weight_sync: str = 'mode = "off"', cp: int = 1, pp: int = 1,
) -> tuple[Path, int]:
    grpc_port, admin_port = free_ports(2)
    config = workdir / run / "deploy.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f"""
[run]
name = "{run}"
admin_token = "{ADMIN}"
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
lr = {lr}
eps = 1e-6
max_grad_norm = 0.5
[trainer.parallel]
tensor_parallel = {tp}
data_parallel = {dp}
context_parallel = {cp}
pipeline_parallel = {pp}
[trainer.checkpoint]
dir = "{workdir / run / 'ckpt'}"
[trainer.weight_sync]
{weight_sync}
""")
    return config, admin_port


class Trainer:
    """One `riptide serve trainer` deployment: its stream, config and current process."""

    def __init__(self, workdir: Path, redis_config: RedisConfig, model_dir: Path, run: str, tp: int,
                 dp: int, **options: Any) -> None:
        self.name = run
        self.config, self.admin_port = _config(workdir, redis_config, model_dir, run, tp, dp,
                                               **options)
        self.ckpt = workdir / run / "ckpt"
        self.log = workdir / run / "trainer.log"
        self.buffer = SampleBuffer(redis_config, run)
        self.proc: subprocess.Popen[bytes] | None = None

    def produce(self, indices: range) -> None:
        for i in indices:
            assert self.buffer.put(scored_group(i, min_response_len=5))

    def start(self) -> None:
        cmd = [sys.executable, "-m", "services.cli", "serve", "trainer", "--config",
               str(self.config)]
        self.proc = process.spawn(cmd, log_path=self.log)

    def wait_for_step(self, step: int) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + 240
        while not Checkpointer(self.ckpt).path(step).exists():
            assert self.proc.poll() is None, f"{self.name} exited: {self._tail()}"
            assert time.monotonic() < deadline, f"{self.name}: no step {step}: {self._tail()}"
            time.sleep(0.1)

    def state(self, step: int) -> dict:  # type: ignore[type-arg]
        return json.loads((Checkpointer(self.ckpt).path(step) / STATE_FILE).read_text())  # type: ignore[no-any-return]

    def shards(self, step: int) -> list[dict]:  # type: ignore[type-arg]
        path = Checkpointer(self.ckpt).path(step)
        return [torch.load(path / f"rank-{r:05d}" / "model.pt", weights_only=False)
                for r in range(2)]

    def _tail(self) -> str:
        return self.log.read_text()[-3000:]


def _last_step(admin_port: int) -> dict[str, Any]:
    state = httpx.get(f"http://127.0.0.1:{admin_port}/admin/state",
                      headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5).json()
    return state["details"]["last_step"]  # type: ignore[no-any-return]


def _merge_tp_shards(shards: list[dict[str, Any]], full: dict[str, Any]) -> dict:  # type: ignore[type-arg]
    """TP=1 layout from TP shards: split dims concatenated (fc1 holds [gate; up] per shard)."""
    merged = {}
    for key, ref in full.items():
        if not isinstance(ref, torch.Tensor):
            continue
        parts = [s[key] for s in shards]
        if parts[0].shape == ref.shape:  # replicated: every rank must hold the same values
            for p in parts[1:]:
                assert torch.equal(p, parts[0]), key
            merged[key] = parts[0]
        elif key.endswith("linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in parts]
            merged[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            dim = next(d for d in range(ref.dim()) if parts[0].shape[d] != ref.shape[d])
            merged[key] = torch.cat(parts, dim=dim)
    return merged


def _merge_pp_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """One-rank names from pipeline stages: stage s's local layer i is global layer
    s * (layers per stage) + i; the embedding is on the first stage, the head on the last."""
    merged = {}
    for stage, shard in enumerate(shards):
        per_stage = len({k.split(".")[2] for k in shard if k.startswith("decoder.layers.")})
        for key, value in shard.items():
            parts = key.split(".")
            if key.startswith("decoder.layers."):
                parts[2] = str(stage * per_stage + int(parts[2]))
            merged[".".join(parts)] = value
    return merged


def _sigterm_all(trainers: list[Trainer]) -> None:
    """SIGTERM every trainer: each exits 0 and leaves none of its worker ranks behind."""
    workers = {t.name: alive(descendants(t.proc.pid)) for t in trainers if t.proc}
    for t in trainers:
        assert t.proc is not None
        t.proc.send_signal(signal.SIGTERM)
    for t in trainers:
        assert t.proc is not None
        assert t.proc.wait(60) == 0, f"{t.name}: {t._tail()}"
    for name, pids in workers.items():
        assert alive(pids) == set(), f"{name}: worker ranks outlived the trainer"


def _compare(name: str, merged: dict, full: dict) -> None:  # type: ignore[type-arg]
    tensors = {k for k, v in full.items() if isinstance(v, torch.Tensor)}
    assert {k for k in merged if k in tensors} == tensors
    diffs = {k: float((merged[k] - full[k]).abs().max()) for k in tensors}
    worst = max(diffs, key=diffs.__getitem__)
    print(f"max |{name} - one rank| =", diffs[worst], "at", worst)
    assert diffs[worst] < 1e-5, (name, diffs)


@pytest.mark.slow
def test_tp2_and_dp2_services_match_one_rank(redis_config: RedisConfig, workdir: Path) -> None:
    from services.common.tiny_model import create_tiny_model

    model_dir = create_tiny_model(workdir / "model", hidden_size=64, num_layers=2)
    layouts = {"one": (1, 1, 1), "tp2": (2, 1, 1), "dp2": (1, 2, 1), "cp2": (1, 1, 2)}
    trainers = {name: Trainer(workdir, redis_config, model_dir, name, tp, dp, cp=cp)
                for name, (tp, dp, cp) in layouts.items()}
    trainers["pp2"] = Trainer(workdir, redis_config, model_dir, "pp2", 1, 1, pp=2)
    try:
        for t in trainers.values():
            t.produce(range(2 * NUM_STEPS))
            t.start()
        for t in trainers.values():
            t.wait_for_step(NUM_STEPS)
        last = {name: _last_step(t.admin_port) for name, t in trainers.items()}
        for name in ("tp2", "dp2", "cp2", "pp2"):
            assert alive(descendants(trainers[name].proc.pid)), f"{name} runs no worker rank"  # type: ignore[union-attr]
        _sigterm_all(list(trainers.values()))
        # Restart from the sharded checkpoint and train one more step on new groups.
        again = [trainers["one"], trainers["tp2"]]
        for t in again:
            t.produce(range(2 * NUM_STEPS, 2 * NUM_STEPS + 2))
            t.start()
        for t in again:
            t.wait_for_step(NUM_STEPS + 1)
        _sigterm_all(again)
    finally:
        for t in trainers.values():
            if t.proc is not None:
                process.stop(t.proc, grace_s=2)

    final = {"one": NUM_STEPS + 1, "tp2": NUM_STEPS + 1, "dp2": NUM_STEPS, "cp2": NUM_STEPS,
             "pp2": NUM_STEPS}
    for name in ("tp2", "dp2", "cp2", "pp2"):
        state = trainers[name].state(final[name])
        produced = [f"group-{i:03d}" for i in range(2 * final[name])]
        assert state["step"] == final[name]
        assert sorted(state["trained_group_ids"]) == produced
        assert len(set(state["trained_group_ids"])) == len(state["trained_group_ids"])

    one = {step: torch.load(Checkpointer(trainers["one"].ckpt).path(step) / "model.pt",
                            weights_only=False) for step in (NUM_STEPS, NUM_STEPS + 1)}
    tp_shards = trainers["tp2"].shards(NUM_STEPS + 1)
    assert tp_shards[0]["embedding.word_embeddings.weight"].shape[0] * 2 == (
        one[NUM_STEPS]["embedding.word_embeddings.weight"].shape[0]
    )
    _compare("tp2", _merge_tp_shards(tp_shards, one[NUM_STEPS + 1]), one[NUM_STEPS + 1])
    for name in ("dp2", "cp2"):
        replicas = trainers[name].shards(NUM_STEPS)
        for key, value in replicas[0].items():  # DP and CP replicas stay identical
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, replicas[1][key]), (name, key)
        _compare(name, replicas[0], one[NUM_STEPS])
    _compare("pp2", _merge_pp_shards(trainers["pp2"].shards(NUM_STEPS)), one[NUM_STEPS])
    for name in ("tp2", "dp2", "cp2", "pp2"):
        # The clip must see the global norm (a TP rank alone sees only its shard, a DP rank
        # only its micro-batches, a CP rank only its tokens' part of the gradient), and the
        # metrics cover the whole batch.
        ref, ours = last["one"], last[name]
        assert abs(ours["metrics"]["grad_norm"] - ref["metrics"]["grad_norm"]) < 1e-4 * (
            ref["metrics"]["grad_norm"]
        ), name
        assert abs(ours["loss"] - ref["loss"]) < 1e-5, name
        assert ours["metrics"]["num_loss_tokens"] == ref["metrics"]["num_loss_tokens"], name


PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def hf_logprobs_worker(
    rank: int, world_size: int, master_port: int, model_path: str, shard_paths: list[str],
    ids: list[int],
) -> dict[str, list[float]]:
    """Log-probs of `ids` from a Hugging Face model holding the merged TP shards (trained),
    and from the checkpoint the trainer started at (original)."""
    from transformers import AutoModelForCausalLM

    from services.testing.hf_models import reference_logprobs
    from services.trainer.model.model import ModelShape, build_gpt_model, load_hf_config
    from services.trainer.model_config import ParallelConfig
    from services.trainer.parallel.parallel import init_parallel, teardown_parallel
    from services.trainer.weights.convert import iter_hf_tensors

    init_parallel(ParallelConfig(), rank=rank, world_size=world_size, master_port=master_port)
    shape = ModelShape.from_hf(load_hf_config(model_path))
    model = build_gpt_model(shape)
    shards = [torch.load(p, weights_only=False) for p in shard_paths]
    missing, _ = model.load_state_dict(_merge_tp_shards(shards, model.state_dict()),
                                       strict=False)
    assert all(k.endswith("_extra_state") for k in missing), missing
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    batch = torch.tensor([ids])
    original = reference_logprobs(hf, batch)[0].tolist()
    hf.load_state_dict(dict(iter_hf_tensors(model, shape, torch.float32)), strict=True)
    trained = reference_logprobs(hf, batch)[0].tolist()
    teardown_parallel()
    return {"original": original, "trained": trained}


@pytest.mark.slow
def test_tp2_service_syncs_engine_directly(redis_config: RedisConfig, workdir: Path) -> None:
    """TP=2 `riptide serve trainer` pushes its weights to a real engine after every step: the
    engine reports the trainer's weight version and scores like the saved checkpoint."""
    from services.common.tiny_model import create_tiny_model
    from services.testing.engine_process import EngineProcess
    from services.testing.trainer_ranks import run_ranks

    model_dir = create_tiny_model(workdir / "model", hidden_size=64, num_layers=2)
    num_steps = 2
    with EngineProcess(model_dir) as engine:
        # lr 1e-2: two Adam steps move the engine's log-probs well away from the original.
        trainer = Trainer(workdir, redis_config, model_dir, "sync", 2, 1, lr=1e-2, weight_sync=(
            f'mode = "direct"\nengine_urls = ["{engine.url}"]\ndtype = "float32"\n'
            "bucket_mb = 0.05"))
        try:
            trainer.produce(range(2 * num_steps))
            trainer.start()
            deadline = time.monotonic() + 240
            while (last := _admin_last_step(trainer)) is None or last["step"] < num_steps:
                assert trainer.proc is not None and trainer.proc.poll() is None, trainer._tail()
                assert time.monotonic() < deadline, f"no step {num_steps}: {trainer._tail()}"
                time.sleep(0.2)
            assert last["weight_version"] == num_steps  # one sync after each step
            assert last["weight_sync_s"] > 0
            version = engine.get("/model_info").json()["weight_version"]
            assert version == str(last["weight_version"])
            out = engine.generate(PROMPT, return_logprob=True, sampling_params={
                "max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True})
            _sigterm_all([trainer])
        finally:
            if trainer.proc is not None:
                process.stop(trainer.proc, grace_s=2)
    ids = PROMPT + out["output_ids"]
    shards = Checkpointer(trainer.ckpt).path(num_steps)
    [reference] = run_ranks(Path(__file__), "hf_logprobs_worker", 1, {
        "model_path": str(model_dir), "ids": ids,
        "shard_paths": [str(shards / f"rank-{r:05d}" / "model.pt") for r in range(2)],
    })
    engine_lp = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert len(engine_lp) == 10
    trained = reference["trained"][len(PROMPT):]
    original = reference["original"][len(PROMPT):]
    diff = max(abs(a - b) for a, b in zip(engine_lp, trained, strict=True))
    moved = max(abs(a - b) for a, b in zip(engine_lp, original, strict=True))
    print(f"max |engine - trained checkpoint| = {diff:.2e}, moved from original {moved:.2e}")
    assert diff < 1e-3, (engine_lp, trained)
    assert moved > 1e-2  # the engine holds the trained weights, not the initial ones


def _admin_last_step(trainer: Trainer) -> dict[str, Any] | None:
    try:
        return _last_step(trainer.admin_port)
    except (httpx.HTTPError, KeyError):
        return None  # the admin app is not up yet
