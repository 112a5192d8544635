"""Colocated weight sync end to end on CPU: the trainer (one or two TP ranks) releases a real
engine process's memory, steps, and sends its weights as shared-memory tensors (the CUDA IPC
payload's CPU form) to `/update_weights_from_tensor`, either itself (colocated_direct) or
through the rollout service's real coordinator (colocated), which resumes the engine's memory;
the engine's log-probs then equal the trainer's own, and differ from the checkpoint's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from services.testing.engine_process import EngineProcess, tiny_model_path
from services.testing.rollout_standin import RolloutStandIn
from services.testing.trainer_ranks import run_ranks

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def colocated_worker(rank: int, world_size: int, master_port: int, model_path: str,
                     engine_url: str, parallel: dict[str, int], rollout_address: str
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
    from services.trainer.weights.weight_ipc import ColocatedWeightSync
    from services.trainer.weights.weight_sync import RolloutWeightSync, build_weight_sync

    layout = init_parallel(ParallelConfig(**parallel), rank=rank, world_size=world_size,
                           master_port=master_port)
    shape = ModelShape.from_hf(load_hf_config(model_path))
    model = build_gpt_model(shape)
    load_hf_checkpoint(model, shape, model_path)
    config = WeightSyncConfig(
        mode="colocated" if rollout_address else "colocated_direct", engine_urls=[engine_url],
        rollout_address=rollout_address or "unused:1", dtype="float32", bucket_mb=0.05)
    sync = build_weight_sync(config, layout.backend)
    assert isinstance(sync, RolloutWeightSync if rollout_address else ColocatedWeightSync)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = torch.tensor([PROMPT + [65, 66, 67, 68]])
    rounds = []
    for version in (1, 2):
        released: Any = None
        if rank == 0:
            sync.release_engines()  # as the trainer does before a step (rollout: an RPC)
            released = httpx.get(f"{engine_url}/get_server_info", timeout=30).json()
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
            "released": released and released.get("memory_released"),
        })
    if rank == 0:
        from transformers import AutoModelForCausalLM

        original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        before = reference_logprobs(original, torch.tensor([ids]))[0, len(PROMPT):]
        rounds[-1]["original"] = before.tolist()
    sync.close()
    teardown_parallel()
    return rounds


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(tiny_model_path(tmp_path_factory.mktemp("tiny"))) as proc:
        yield proc


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "via_rollout"), [(1, False), (2, False), (1, True), (2, True)])
def test_engine_logprobs_equal_trainer_after_colocated_sync(engine: EngineProcess, tp: int,
                                                           via_rollout: bool) -> None:
    with RolloutStandIn(engine.url) if via_rollout else nullcontext() as rollout:
        results = run_ranks(Path(__file__), "colocated_worker", tp, {
            "model_path": str(engine.model_path), "engine_url": engine.url,
            "parallel": {"tensor_parallel": tp},
            "rollout_address": rollout.address if rollout else ""})
        if rollout:
            assert rollout.committed == [1, 2]
    rounds = results[0]
    for expected_version, result in zip(("1", "2"), rounds, strict=True):
        assert result["released"] == ["cuda_graph", "kv_cache", "weights"]
        assert result["version"] == expected_version
        assert result["num_buckets"] > 1
        diff = max(abs(a - b) for a, b in zip(result["engine"], result["trainer"], strict=True))
        assert diff < 1e-3, result
    moved = max(abs(a - b) for a, b in zip(rounds[-1]["engine"], rounds[-1]["original"],
                                           strict=True))
    assert moved > 1e-2  # the engine holds the trained weights, not the checkpoint's
    assert engine.get("/get_server_info").json()["memory_released"] == []
