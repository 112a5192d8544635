"""Colocated mode on CUDA: a real engine process (slots decode replayed from CUDA graphs)
releases its memory (the device's free memory rises), queues a request meanwhile, resumes,
takes new weights as CUDA IPC handles from this process, and then decodes what transformers
decodes with those weights; its graphs were captured again on the moved buffers."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.tiny_model import create_tiny_model
from services.testing.engine_process import EngineProcess, tiny_model_path
from services.trainer.weights.weight_ipc import ColocatedWeightSender

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CUDA = torch.device("cuda")
PROMPT = [5, 17, 3, 99, 42, 7, 61]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def greedy(model: Any, tokens: list[int]) -> list[int]:
    ids = list(tokens)
    with torch.no_grad():
        for _ in range(GREEDY["max_new_tokens"]):
            ids.append(int(model(torch.tensor([ids], device=CUDA)).logits[0, -1].argmax()))
    return ids[len(tokens):]


def test_release_queue_resume_and_ipc_update(tmp_path: Path) -> None:
    old = tiny_model_path(tmp_path / "old")
    new = AutoModelForCausalLM.from_pretrained(create_tiny_model(tmp_path / "new", seed=1),
                                               dtype=torch.float32).to(CUDA).eval()
    want = greedy(new, PROMPT)
    # 257 slots x 4,096 tokens: ~0.5 GB of KV slots, which a release must give back.
    args = ["--device", "cuda", "--dtype", "float32", "--max-running-requests", "256",
            "--max-total-tokens", str(256 * 4096)]
    with EngineProcess(old, extra_args=args, start_timeout_s=300) as engine:
        sender = ColocatedWeightSender([engine.url], torch.float32, timeout_s=120)
        assert engine.generate(PROMPT, sampling_params=GREEDY)["output_ids"] != want
        free_before = torch.cuda.mem_get_info()[0]
        released = sender.release()[0]
        freed = torch.cuda.mem_get_info()[0] - free_before
        assert released["released"] == ["cuda_graph", "kv_cache", "weights"]
        assert released["freed_bytes"] > 400e6 and freed > 400e6, (released, freed)
        out: dict[str, Any] = {}
        waiting = threading.Thread(target=lambda: out.update(
            engine.generate(PROMPT, sampling_params=GREEDY)))
        waiting.start()
        time.sleep(1.0)
        assert not out  # queued while released
        refused = engine.post("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]})
        assert refused.status_code == 400 and "resume" in refused.json()["message"]
        sender.resume(["weights"])
        named = [(n, t.detach().contiguous()) for n, t in new.state_dict().items()]
        assert sender.send([named[:5], named[5:]], "ipc-1") == (2, len(named), sum(
            t.numel() * 4 for _, t in named))
        resumed = sender.resume(["kv_cache"])[0]
        assert resumed["released"] == [] and resumed["graph_capture_s"] > 0
        waiting.join(timeout=60)
        assert out["output_ids"] == want and out["meta_info"]["weight_version"] == "ipc-1"
        assert engine.generate(PROMPT, sampling_params=GREEDY)["output_ids"] == want
        sender.close()
        log = engine.log_tail(20000)
    assert log.count("captured") >= 2  # at start, and again after the resume
