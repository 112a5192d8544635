"""Weight updates over gloo: a separate trainer process (rank 0) broadcasts new weights."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common import process
from services.common.ports import free_port
from services.common.tiny_model import create_tiny_model
from services.testing.engine_process import EngineProcess, tiny_model_path
from services.testing.weight_broadcaster import load_state_dict, update_request

pytestmark = pytest.mark.slow

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
REPO = Path(__file__).resolve().parents[2]


def hf_greedy(model_path: Path) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=GREEDY["max_new_tokens"],
        eos_token_id=[],
        pad_token_id=0,
    )
    return out[0, len(PROMPT) :].tolist()


def test_trainer_broadcast_replaces_weights(tmp_path: Path) -> None:
    old_path = tiny_model_path(tmp_path / "old")
    new_path = create_tiny_model(tmp_path / "new", seed=1)
    old_out, new_out = hf_greedy(old_path), hf_greedy(new_path)
    assert old_out != new_out
    state = load_state_dict(new_path)
    group = "wu_test"
    with EngineProcess(old_path, dp_size=2) as engine:

        def outputs() -> list[list[int]]:
            return [
                engine.generate(PROMPT, sampling_params=GREEDY, routed_dp_rank=r)["output_ids"]
                for r in (0, 1)
            ]

        assert outputs() == [old_out, old_out]
        body = update_request(state, group_name=group, version="v1")
        assert engine.post("/update_weights_from_distributed", body).status_code == 400

        port = free_port()
        trainer = process.spawn(
            [
                sys.executable,
                "-m",
                "services.testing.weight_broadcaster",
                "--model",
                str(new_path),
                "--master-port",
                str(port),
                "--group-name",
                group,
            ],
            log_path=tmp_path / "trainer.log",
            cwd=REPO,
        )
        try:
            init = engine.post(
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": group,
                    "backend": "gloo",
                },
            )
            assert init.status_code == 200 and init.json()["success"], init.text

            # Bad requests are refused before any tensor moves, and change nothing.
            bad_shape = {**body, "shapes": [[1, 2]] + body["shapes"][1:]}
            resp = engine.post("/update_weights_from_distributed", bad_shape)
            assert resp.status_code == 400 and body["names"][0] in resp.json()["message"]
            bad_name = {**body, "names": ["model.nope.weight"] + body["names"][1:]}
            resp = engine.post("/update_weights_from_distributed", bad_name)
            assert resp.status_code == 400 and "model.nope.weight" in resp.json()["message"]
            bad_dtype = {**body, "dtypes": ["float99"] * len(state)}
            assert engine.post("/update_weights_from_distributed", bad_dtype).status_code == 400
            assert outputs() == [old_out, old_out]
            assert engine.get("/model_info").json()["weight_version"] == "default"

            # A request in flight finishes before the update loads (the engine is not paused).
            with ThreadPoolExecutor(1) as pool:
                long = pool.submit(
                    engine.generate, PROMPT, sampling_params={**GREEDY, "max_new_tokens": 64}
                )
                time.sleep(0.1)
                resp = engine.post("/update_weights_from_distributed", body)
                assert resp.status_code == 200 and resp.json()["success"], resp.text
                before = long.result(30)
            assert before["output_ids"][:16] == old_out
            assert before["meta_info"]["weight_version"] == "default"
            assert trainer.wait(30) == 0
        finally:
            process.stop(trainer, grace_s=1)

        assert outputs() == [new_out, new_out]
        after = engine.generate(PROMPT, sampling_params=GREEDY)
        assert after["meta_info"]["weight_version"] == "v1"
        assert engine.get("/get_model_info").json()["weight_version"] == "v1"
        destroy = engine.post("/destroy_weights_update_group", {"group_name": group})
        assert destroy.status_code == 200 and destroy.json()["success"]
