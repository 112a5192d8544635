"""End to end: after a weight sync the built-in engine's log-probs equal the trainer's own.

The trainer (one or two TP ranks) loads the tiny model, takes an optimizer step so its weights
differ from the engine's, broadcasts them to a real engine process over gloo, and compares the
engine's log-probs of a greedy continuation with its own. Two rounds check that the group is
reused and the version advances.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from services.testing.engine_process import EngineProcess, tiny_model_path
from services.testing.rollout_standin import RolloutStandIn
from services.testing.trainer_ranks import run_ranks

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def sync_worker(
    rank: int, world_size: int, master_port: int, model_path: str, engine_url: str,
    parallel: dict[str, int], rollout_address: str,
) -> list[dict[str, Any]]:
    import httpx
    import torch
    import torch.distributed as dist

    from services.testing.hf_models import reference_logprobs
    from services.trainer.model.model import ModelShape, build_gpt_model, load_hf_config
    from services.trainer.model_config import ParallelConfig, WeightSyncConfig
    from services.trainer.objective.logprobs import token_logprobs
    from services.trainer.parallel.parallel import init_parallel, teardown_parallel
    from services.trainer.weights.convert import load_hf_checkpoint
    from services.trainer.weights.weight_sync import build_weight_sync

    layout = init_parallel(ParallelConfig(**parallel), rank=rank, world_size=world_size,
                           master_port=master_port)
    shape = ModelShape.from_hf(load_hf_config(model_path))
    model = build_gpt_model(shape)
    load_hf_checkpoint(model, shape, model_path)
    config = WeightSyncConfig(
        mode="rollout" if rollout_address else "direct", engine_urls=[engine_url],
        rollout_address=rollout_address or "unused:1", dtype="float32", bucket_mb=0.05)
    sync = build_weight_sync(config, layout.backend)
    assert sync is not None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = torch.tensor([PROMPT + [65, 66, 67, 68]])
    rounds = []
    for version in (1, 2):
        optimizer.zero_grad()
        (-token_logprobs(model, batch).mean()).backward()
        optimizer.step()
        report = sync.sync(model, shape, version)
        reply: list[Any] = [None]
        if rank == 0:
            reply[0] = httpx.post(f"{engine_url}/generate", timeout=60, json={
                "input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 10, "temperature": 0.0,
                                    "ignore_eos": True},
            }).json()
        dist.broadcast_object_list(reply, src=0)
        out = reply[0]
        ids = PROMPT + out["output_ids"]
        with torch.no_grad():
            ours = token_logprobs(model, torch.tensor([ids]))[0, len(PROMPT):]
        rounds.append({
            "engine": [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
            "trainer": ours.tolist(),
            "version": out["meta_info"]["weight_version"],
            "num_buckets": report.num_buckets,
        })
    if rank == 0:
        from transformers import AutoModelForCausalLM

        original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        before = reference_logprobs(original, torch.tensor([ids]))[0, len(PROMPT):]
        rounds[-1]["original"] = before.tolist()
    sync.close()
    teardown_parallel()
    return rounds


def refused_worker(
    rank: int, world_size: int, master_port: int, model_path: str, engine_url: str
) -> dict[str, Any]:
    import time

    from services.common.errors import Unavailable
    from services.testing.hf_models import random_hf_model
    from services.trainer.model.model import ModelShape, build_gpt_model, load_hf_config
    from services.trainer.model_config import ParallelConfig, WeightSyncConfig
    from services.trainer.parallel.parallel import init_parallel
    from services.trainer.weights.convert import load_hf_checkpoint, load_hf_weights
    from services.trainer.weights.weight_sync import DirectEngineWeightSync

    layout = init_parallel(ParallelConfig(), rank=rank, world_size=world_size,
                           master_port=master_port)
    config = WeightSyncConfig(mode="direct", engine_urls=[engine_url], dtype="float32")
    sync = DirectEngineWeightSync(config, layout.backend)
    other = random_hf_model("llama")  # shapes the engine's model does not have
    wrong_shape = ModelShape.from_hf(other.config)
    wrong = build_gpt_model(wrong_shape)
    load_hf_weights(wrong, wrong_shape, other.state_dict())
    start = time.monotonic()
    try:
        sync.sync(wrong, wrong_shape, 7)
        error = ""
    except Unavailable as exc:
        error = str(exc)
    refused_s = time.monotonic() - start
    shape = ModelShape.from_hf(load_hf_config(model_path))
    model = build_gpt_model(shape)
    load_hf_checkpoint(model, shape, model_path)
    sync.sync(model, shape, 8)
    sync.close()
    return {"error": error, "refused_s": refused_s}


@pytest.mark.slow
def test_refused_bucket_fails_fast_and_next_sync_works(engine: EngineProcess) -> None:
    [result] = run_ranks(Path(__file__), "refused_worker", 1, {
        "model_path": str(engine.model_path), "engine_url": engine.url,
    })
    assert "update_weights_from_distributed" in result["error"]
    assert result["refused_s"] < 30
    assert engine.get("/model_info").json()["weight_version"] == "8"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(tiny_model_path(tmp_path_factory.mktemp("tiny"))) as proc:
        yield proc


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "via_rollout"), [(1, False), (2, False), (1, True), (2, True)])
def test_engine_logprobs_equal_trainer_after_sync(
    engine: EngineProcess, tp: int, via_rollout: bool
) -> None:
    with RolloutStandIn(engine.url) if via_rollout else nullcontext() as rollout:
        results = run_ranks(Path(__file__), "sync_worker", tp, {
            "model_path": str(engine.model_path), "engine_url": engine.url,
            "parallel": {"tensor_parallel": tp}, "rollout_address": rollout.address if rollout
            else "",
        })
        if rollout:
            assert rollout.committed == [1, 2]
    rounds = results[0]
    for expected_version, result in zip(("1", "2"), rounds, strict=True):
        assert result["version"] == expected_version
        assert result["num_buckets"] > 1
        assert len(result["engine"]) == 10
        diff = max(abs(a - b) for a, b in zip(result["engine"], result["trainer"], strict=True))
        assert diff < 1e-3, result
    moved = max(abs(a - b) for a, b in zip(rounds[-1]["engine"], rounds[-1]["original"],
                                           strict=True))
    assert moved > 1e-2  # the engine really holds the trained weights, not the checkpoint
    if tp == 2:
        assert results[1][-1]["trainer"] == pytest.approx(rounds[-1]["trainer"], abs=1e-6)


@pytest.mark.slow
def test_moe_engine_takes_expert_parallel_weights(tmp_path: Path) -> None:
    """An EP=2 trainer of a Qwen2-MoE model sends per-expert checkpoint names; the engine
    (transformers 5 fuses its experts) loads them and then scores like the trainer."""
    import shutil

    from services.testing.hf_models import random_hf_model

    tiny = tiny_model_path(tmp_path / "tiny")
    moe = tmp_path / "moe"
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    random_hf_model("qwen2_moe", vocab_size=vocab, num_layers=2).save_pretrained(moe)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / name, moe / name)
    with EngineProcess(moe) as engine:
        results = run_ranks(Path(__file__), "sync_worker", 2, {
            "model_path": str(moe), "engine_url": engine.url, "rollout_address": "",
            "parallel": {"expert_parallel": 2, "data_parallel": 2},
        })  # fmt: skip
    for result in results[0]:
        diff = max(abs(a - b) for a, b in zip(result["engine"], result["trainer"], strict=True))
        assert diff < 1e-3, result
    moved = max(abs(a - b) for a, b in zip(results[0][-1]["engine"],
                                           results[0][-1]["original"], strict=True))
    assert moved > 1e-2
