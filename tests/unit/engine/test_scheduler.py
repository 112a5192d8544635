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


@pytest.mark.parametrize("backend", ["transformers", "slots"])
def test_a_group_prefills_its_shared_prompt_once(model_path: Path, backend: str) -> None:
    engine = Engine(EngineConfig(model_path=str(model_path), decode_backend=backend))
    sched = engine.schedulers[0]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompt = [(5 * i) % 200 for i in range(40)]
    group = [greedy(prompt, 8) for _ in range(4)]
    other = greedy([7] * 30, 8)  # shares nothing: prefilled with the first
    for req in [*group, other]:
        engine.submit(req)
    sched.step()
    assert sched.running == [group[0], other]  # the rest wait for the prompt to be cached
    while sched.step():
        pass
    assert [req.cached_tokens for req in group] == [0, 39, 39, 39]
    want = reference_greedy(model, prompt, 8)
    assert all(req.output_ids == want for req in group)
    if backend == "slots":
        assert sched.batch.kv.num_free == sched.batch.kv.num_slots  # every slot came back


def test_long_prompts_prefill_in_pieces(model_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    from services.engine import slot_batch

    monkeypatch.setattr(slot_batch, "PIECE_TOKENS", 8)
    monkeypatch.setattr(slot_batch, "CHUNK_CELLS", 600)  # at most a couple of rows a forward
    engine = Engine(EngineConfig(model_path=str(model_path), decode_backend="slots",
                                 prefix_cache_num_tokens=0))
    sched = engine.schedulers[0]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = [[(3 * i + k) % 250 for i in range(n)] for k, n in enumerate((30, 5, 51))]
    reqs = [greedy(p, 6) for p in prompts]
    reqs[2].return_logprob, reqs[2].logprob_start_len = True, 0
    for req in reqs:
        engine.submit(req)
    while sched.step():
        pass
    for req in reqs:
        assert req.output_ids == reference_greedy(model, req.input_ids, 6)
    with torch.no_grad():
        logits = model(torch.tensor([prompts[2]])).logits[0, :-1]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompts[2][1:])[:, None])
    got = torch.tensor(reqs[2].input_logprobs[1:])
    torch.testing.assert_close(got, want.squeeze(1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["transformers", "slots"])
def test_a_failed_prefill_aborts_its_requests_and_frees_their_kv(
    model_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.engine import scheduler

    engine = Engine(EngineConfig(model_path=str(model_path), decode_backend=backend))
    sched = engine.schedulers[0]
    updates: list = []
    reqs = [greedy([1, 2, 3 + i], 4) for i in range(3)]
    for req in reqs:
        req.emit = updates.append
        engine.submit(req)

    def broken(*_: object) -> None:
        raise RuntimeError("sampler broke")

    monkeypatch.setattr(scheduler, "sample_tokens", broken)
    assert engine._step(sched) is False
    assert [u.finish_reason["message"] for u in updates] == [
        "engine error: RuntimeError: sampler broke"] * 3
    assert not sched.waiting and not sched.running
    if backend == "slots":
        assert sched.batch.kv.num_free == sched.batch.kv.num_slots
