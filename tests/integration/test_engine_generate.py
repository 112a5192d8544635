"""The built-in engine against transformers: greedy decoding, log-probs, prefix cache, API shape."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.testing.engine_process import EngineProcess, tiny_model_path

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[EngineProcess]:
    with EngineProcess(model_path, dp_size=2) as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(model_path: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_greedy(model: AutoModelForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=[],
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [
        torch.randint(0, 256, (int(3 + 5 * i % 17),), generator=gen).tolist() for i in range(count)
    ]


def test_greedy_matches_transformers_alone_and_batched(engine, reference) -> None:
    batch = prompts(6)
    expected = [hf_greedy(reference, p, GREEDY["max_new_tokens"]) for p in batch]
    alone = engine.generate(batch[0], sampling_params=GREEDY, routed_dp_rank=0)
    assert alone["output_ids"] == expected[0]
    with ThreadPoolExecutor(len(batch)) as pool:
        results = list(
            pool.map(lambda p: engine.generate(p, sampling_params=GREEDY, routed_dp_rank=1), batch)
        )
    assert [r["output_ids"] for r in results] == expected
    meta = results[0]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": GREEDY["max_new_tokens"]}
    assert meta["prompt_tokens"] == len(batch[0])
    assert meta["completion_tokens"] == GREEDY["max_new_tokens"]


def test_logprobs_equal_forward_log_softmax(engine, reference) -> None:
    prompt = prompts(1)[0]
    out = engine.generate(
        prompt,
        return_logprob=True,
        sampling_params={
            "temperature": 1.0,
            "max_new_tokens": 16,
            "sampling_seed": 3,
            "ignore_eos": True,
        },
    )
    ids = out["output_ids"]
    entries = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == ids and all(e[2] is None for e in entries)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + ids])).logits[0]
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    want = logprobs.gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    got = torch.tensor([e[0] for e in entries])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_seeded_sampling_is_reproducible_under_concurrency(engine) -> None:
    params = {
        "temperature": 0.9,
        "top_p": 0.95,
        "top_k": 50,
        "max_new_tokens": 12,
        "sampling_seed": 11,
        "ignore_eos": True,
    }
    prompt = prompts(2)[1]
    alone = engine.generate(prompt, sampling_params=params)["output_ids"]
    with ThreadPoolExecutor(4) as pool:
        crowd = list(
            pool.map(
                lambda _: engine.generate(prompt, sampling_params=params)["output_ids"], range(4)
            )
        )
    assert crowd == [alone] * 4
    other = engine.generate(prompt, sampling_params={**params, "sampling_seed": 12})
    assert other["output_ids"] != alone


def test_second_turn_reuses_the_first_turns_kv(engine, reference) -> None:
    first_prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    first = engine.generate(first_prompt, sampling_params=GREEDY, routed_dp_rank=0)
    second_prompt = first_prompt + first["output_ids"] + [40, 41, 42]
    second = engine.generate(second_prompt, sampling_params=GREEDY, routed_dp_rank=0)
    # Every token of turn one except its last output (never fed forward) had its KV cached.
    shared = len(first_prompt) + len(first["output_ids"]) - 1
    assert second["meta_info"]["cached_tokens"] == shared
    assert second["output_ids"] == hf_greedy(reference, second_prompt, GREEDY["max_new_tokens"])
    # The other dp rank has its own cache.
    elsewhere = engine.generate(second_prompt, sampling_params=GREEDY, routed_dp_rank=1)
    assert elsewhere["meta_info"]["cached_tokens"] == 0
    assert elsewhere["output_ids"] == second["output_ids"]


def test_stop_tokens_strings_and_text(engine) -> None:
    prompt = prompts(3)[2]
    free = engine.generate(prompt, sampling_params=GREEDY)["output_ids"]
    stop_at = free[5]
    first_hit = free.index(stop_at)
    out = engine.generate(prompt, sampling_params={**GREEDY, "stop_token_ids": [stop_at]})
    assert out["output_ids"] == free[: first_hit + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    text = engine.generate([104, 105], sampling_params={"max_new_tokens": 0})
    assert text["output_ids"] == [] and text["meta_info"]["finish_reason"]["type"] == "length"
    by_text = engine.post("/generate", {"text": "hi there", "sampling_params": GREEDY}).json()
    assert by_text["meta_info"]["prompt_tokens"] == len(b"hi there")
    assert isinstance(by_text["text"], str)


def test_batched_input_and_stream(engine) -> None:
    batch = prompts(3)
    many = engine.post("/generate", {"input_ids": batch, "sampling_params": GREEDY}).json()
    single = [engine.generate(p, sampling_params=GREEDY)["output_ids"] for p in batch]
    assert [r["output_ids"] for r in many] == single
    chunks = []
    with httpx.stream(
        "POST",
        f"{engine.url}/generate",
        timeout=60,
        json={"input_ids": batch[0], "sampling_params": GREEDY, "stream": True},
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    import json

    parsed = [json.loads(c) for c in chunks[:-1]]
    assert parsed[-1]["output_ids"] == single[0]
    assert parsed[0]["meta_info"]["finish_reason"] is None
    assert len(parsed) > 1
