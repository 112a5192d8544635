"""The engine's sampler: greedy, temperature, top-k, top-p, per-request seeds, log-probs."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequest
from services.engine.request import SamplingParams
from services.engine.sampling import sample_filtered, sample_tokens


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_take_the_argmax_with_raw_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=5.0)]
    tokens, logprobs = sample_tokens(logits, params, [gen(0), gen(1)])
    assert tokens.tolist() == [1, 0]
    want = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    assert torch.allclose(logprobs, want)


def test_logprobs_use_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([[0.5, 1.5, -1.0, 2.0]])
    tokens, logprobs = sample_tokens(logits, [SamplingParams(temperature=0.5)], [gen(3)])
    want = torch.log_softmax(logits / 0.5, -1)[0, tokens[0]]
    assert torch.allclose(logprobs[0], want)


def test_seeded_rows_do_not_depend_on_their_batch() -> None:
    logits = torch.randn(4, 50, generator=gen(0))
    params = [SamplingParams(temperature=1.0)] * 4
    together, _ = sample_tokens(logits, params, [gen(s) for s in (7, 8, 9, 10)])
    alone, _ = sample_tokens(logits[2:3], params[:1], [gen(9)])
    assert together[2] == alone[0]


def test_sampling_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()[None].expand(4000, -1)
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens, _ = sample_tokens(logits, params, [gen(i) for i in range(4000)])
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_top_k_and_top_p_restrict_the_support() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.3, 0.2]]).expand(500, -1)
    uniforms = torch.rand(500, generator=gen(1))
    top2 = sample_filtered(probs, top_k=[2] * 500, top_p=[1.0] * 500, uniforms=uniforms)
    assert set(top2.tolist()) == {1, 2}
    # Mass before token 3 (sorted 0.4, 0.3, 0.2) is 0.7 < 0.75: three tokens are kept.
    nucleus = sample_filtered(probs, top_k=[-1] * 500, top_p=[0.75] * 500, uniforms=uniforms)
    assert set(nucleus.tolist()) == {1, 2, 3}
    tiny = sample_filtered(probs, top_k=[-1] * 500, top_p=[0.01] * 500, uniforms=uniforms)
    assert set(tiny.tolist()) == {1}


@pytest.mark.parametrize(
    "raw",
    [
        {"top_p": 0},
        {"top_k": 0},
        {"temperature": -1},
        {"max_new_tokens": -1},
        {"regex": "a"},
        {"n": 0},
        {"logit_bias": {"x": 1}},
        {"structural_tag": "{}"},
        {"frequency_penalty": 0.5},
        {"typo": 1},
        {"stop": [""]},
    ],
)
def test_invalid_or_unsupported_params_are_rejected(raw: dict) -> None:
    with pytest.raises(InvalidRequest):
        SamplingParams.parse(raw)


def test_params_parse_sglang_defaults_and_aliases() -> None:
    params = SamplingParams.parse({"stop": "END", "max_new_tokens": 5, "min_p": 0.0})
    assert params.stop == ["END"] and params.max_new_tokens == 5 and params.top_k == -1
    assert SamplingParams.parse({"temperature": 0}).greedy


def test_logit_bias_moves_greedy_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    params = SamplingParams.parse({"temperature": 0, "logit_bias": {"2": 5.0}})
    tokens, logprobs = sample_tokens(logits, [params], [gen(0)])
    assert tokens.tolist() == [2]
    want = torch.log_softmax(torch.tensor([[0.0, 3.0, 6.0]]), -1)[0, 2]
    assert torch.allclose(logprobs[0], want)


def test_stream_interval_and_n_are_accepted() -> None:
    params = SamplingParams.parse({"stream_interval": 4, "n": 3})
    assert params.n == 3


def test_random_streams_depend_only_on_their_seed() -> None:
    from services.engine.random_stream import BLOCK, RandomStream

    logits = torch.randn(3, 50, generator=gen(0))
    params = [SamplingParams(temperature=1.0)] * 3
    batched = [RandomStream(s) for s in (7, 8, 9)]
    alone = RandomStream(8)
    for _ in range(BLOCK + 5):  # across a block boundary
        together, _ = sample_tokens(logits, params, batched)
        single, _ = sample_tokens(logits[1:2], params[:1], [alone])
        assert together[1] == single[0]
    draws = [RandomStream(3).next_uniform() for _ in range(2)]
    assert draws[0] == draws[1] and 0.0 <= draws[0] < 1.0
