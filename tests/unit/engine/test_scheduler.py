"""The engine's scheduler in-process: requests join and leave a running batch between steps,
and every one still decodes exactly what a lone full forward pass would pick."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.tiny_model import create_tiny_model
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.request import GenRequest, SamplingParams


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny"))


def reference_greedy(model: AutoModelForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def greedy(prompt: list[int], n: int) -> GenRequest:
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    return GenRequest(input_ids=prompt, params=params)


@pytest.mark.parametrize("backend", ["transformers", "slots"])
def test_joining_and_leaving_rows_keep_exact_greedy(model_path: Path, backend: str) -> None:
    engine = Engine(EngineConfig(model_path=str(model_path), decode_backend=backend))
    sched = engine.schedulers[0]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    first = greedy([1, 2, 3, 4, 5, 6, 7, 8, 9], 20)
    engine.submit(first)
    for _ in range(5):
        sched.step()
    late = [greedy([50, 51], 6), greedy([60, 61, 62, 63], 12), greedy([1, 2, 3, 4, 70], 9)]
    for req in late:
        engine.submit(req)
    sizes = []
    while sched.step():
        sizes.append(len(sched.running))
    assert max(sizes) == 4 and sizes[-1] <= 1  # joined mid-flight, left one by one
    for req in [first, *late]:
        want = reference_greedy(model, req.input_ids, req.params.max_new_tokens)
        assert req.output_ids == want
    # The last request shared [1, 2, 3, 4] with the first, already cached when it arrived.
    assert late[2].cached_tokens == 4
    assert sched.batch.size == 0 and sched.num_used_tokens == 0


@pytest.mark.parametrize("backend", ["transformers", "slots"])
def test_retract_then_resume_matches_uninterrupted(model_path: Path, backend: str) -> None:
    engine = Engine(EngineConfig(model_path=str(model_path), prefix_cache_num_tokens=0,
                                 decode_backend=backend))
    sched = engine.schedulers[0]
    plain, interrupted = greedy([9, 8, 7], 15), greedy([9, 8, 7], 15)
    engine.submit(plain)
    while sched.step():
        pass
    engine.submit(interrupted)
    for _ in range(6):
        sched.step()
    engine.pause("retract")
    assert sched.running == [] and list(sched.waiting) == [interrupted]
    engine.resume()
    while sched.step():
        pass
    assert interrupted.output_ids == plain.output_ids and interrupted.num_retractions == 1
