"""Weight updates over NCCL: trainer rank 0 on one GPU broadcasts to an engine on another."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from services.common import process
from services.common.ports import free_port
from services.common.tiny_model import create_tiny_model
from services.testing.engine_process import EngineProcess, tiny_model_path
from services.testing.weight_broadcaster import load_state_dict, update_request

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
REPO = Path(__file__).resolve().parents[2]


def test_nccl_broadcast_replaces_engine_weights(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: trainer rank 0 and the engine")
    old_path = tiny_model_path(tmp_path / "old")
    new_path = create_tiny_model(tmp_path / "new", seed=1)
    group = "wu_nccl"
    with EngineProcess(old_path, extra_args=["--device", "cuda:1", "--dtype", "float32"]) as engine:
        before = engine.generate(PROMPT, sampling_params=GREEDY)["output_ids"]
        port = free_port()
        trainer = process.spawn(
            [sys.executable, "-m", "services.testing.weight_broadcaster", "--model",
             str(new_path), "--master-port", str(port), "--group-name", group,
             "--backend", "nccl", "--device", "cuda:0"],
            log_path=tmp_path / "trainer.log", cwd=REPO)
        try:
            init = engine.post("/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": group, "backend": "nccl"})
            assert init.status_code == 200 and init.json()["success"], init.text
            body = update_request(load_state_dict(new_path), group_name=group, version="7")
            resp = engine.post("/update_weights_from_distributed", body)
            assert resp.status_code == 200 and resp.json()["success"], resp.text
            # Tearing down an NCCL communicator waits for the peer: leave on both sides at once.
            with ThreadPoolExecutor(1) as pool:
                destroy = pool.submit(engine.post, "/destroy_weights_update_group",
                                      {"group_name": group})
                assert trainer.wait(120) == 0, (tmp_path / "trainer.log").read_text()
                assert destroy.result(120).status_code == 200
        finally:
            process.stop(trainer, grace_s=1)
        with EngineProcess(new_path, extra_args=["--device", "cuda:1",
                                                 "--dtype", "float32"]) as reference:
            expected = reference.generate(PROMPT, sampling_params=GREEDY)["output_ids"]
        after = engine.generate(PROMPT, sampling_params=GREEDY)
    assert before != expected, "the two models must differ for the test to mean anything"
    assert after["output_ids"] == expected
    assert after["meta_info"]["weight_version"] == "7"
