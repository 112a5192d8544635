"""The fused output layer + log-prob (fused_output.py) against logits then chunked log-probs:
the same log-probs and gradients for hidden states and weight, chunked or not, tied or not,
padded or packed rows (one rank; TP 2 and SP in tests/integration/test_trainer_fused_output.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from services.common.ports import free_port
from services.testing.hf_models import random_hf_model
from services.trainer.model.model import ModelShape, build_gpt_model
from services.trainer.model_config import ParallelConfig
from services.trainer.objective.chunked_logprobs import target_logprobs
from services.trainer.objective.fused_output import fusable, hidden_logprobs
from services.trainer.objective.logprobs import token_logprobs
from services.trainer.parallel.parallel import init_parallel, teardown_parallel
from services.trainer.weights.convert import load_hf_weights


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    teardown_parallel()


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_hidden_logprobs_equal_logits_then_logprobs(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.trainer.objective import fused_output

    monkeypatch.setattr(fused_output, "TORCH_ROWS", 3)  # fp32 passes inside a chunk too
    gen = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(13, 8, generator=gen, requires_grad=True)
    weight = torch.randn(40, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 40, (13,), generator=gen)
    upstream = torch.randn(13, generator=gen)
    got = hidden_logprobs(hidden, weight, targets, 0.8, chunk_tokens=chunk)
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    want = target_logprobs(hidden @ weight.t(), targets, 0.8)
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight))
    # fp32 rounding: a matmul of a chunk's rows sums in another order than the whole one's
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_bad_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match="temperature must be positive"):
        hidden_logprobs(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long), 0)


@pytest.mark.parametrize("tied", [False, True])
def test_model_logprobs_and_grads_equal_unfused(tied: bool) -> None:
    hf = random_hf_model("qwen2", tie_word_embeddings=tied)
    shape = ModelShape.from_hf(hf.config)
    model = build_gpt_model(shape)
    load_hf_weights(model, shape, hf.state_dict())
    assert fusable(model)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 96, (2, 11), generator=gen)
    weights = torch.randn(ids.shape, generator=gen)
    for rows, cu in ((ids, None), (ids.reshape(1, -1), [0, 11, 22])):
        runs = []
        for fused in (False, True):
            model.zero_grad()
            lp = token_logprobs(model, rows, 0.7, cu, fused=fused)
            (lp * weights.reshape(rows.shape)).sum().backward()
            runs.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (want, want_grads), (got, got_grads) = runs
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert "forward" not in vars(model.output_layer)  # the swap is undone


def test_auto_fuses_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.trainer.objective import fused_output

    hf = random_hf_model("qwen2")
    shape = ModelShape.from_hf(hf.config)
    model = build_gpt_model(shape)
    calls: list[int] = []
    real = fused_output.hidden_logprobs

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_output, "hidden_logprobs", spy)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    token_logprobs(model, ids)  # auto, on the CPU: fused
    token_logprobs(model, ids, fused=False)
    assert calls == [1]


@pytest.mark.parametrize("tied", [False, True])
def test_auto_fuses_on_a_gpu_where_whole_logits_would_be_large(
    tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.trainer.objective import fused_output

    hf = random_hf_model("qwen2", tie_word_embeddings=tied)
    model = build_gpt_model(ModelShape.from_hf(hf.config))
    vocab = hf.config.vocab_size
    # 4 bytes a float32 logit: 10 tokens' whole logits are 40 x vocab bytes
    assert fused_output.logits_bytes(model, 10) == 10 * vocab * 4
    monkeypatch.setattr(fused_output, "on_cuda", lambda _model: True)
    monkeypatch.setattr(fused_output, "LARGE_LOGITS_BYTES", 40 * vocab)
    assert not fused_output.auto_fused(model, 10)  # at the limit: logits kept on a GPU
    assert fused_output.auto_fused(model, 11)  # past it: fused
    monkeypatch.setattr(fused_output, "on_cuda", lambda _model: False)
    assert fused_output.auto_fused(model, 1)  # host RAM: always fused


@pytest.mark.parametrize("fused", [False, True])
def test_scored_logprobs_are_the_loss_tokens_only(fused: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With the loss mask as `scored`, the log-probs of scored tokens and the gradients of a
    masked loss equal the whole row's; every other position is 0, and the fused output layer
    is asked for the scored tokens' rows alone."""
    from services.trainer.objective import fused_output

    hf = random_hf_model("qwen2", tie_word_embeddings=True)
    shape = ModelShape.from_hf(hf.config)
    model = build_gpt_model(shape)
    load_hf_weights(model, shape, hf.state_dict())
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 96, (1, 24), generator=gen)
    mask = torch.zeros(ids.shape)
    mask[0, [4, 5, 6, 13, 20, 21, 22, 23]] = 1.0  # replies between prompts and outputs
    weights = torch.randn(ids.shape, generator=gen) * mask
    asked: list[int] = []
    real = fused_output.hidden_logprobs

    def spy(hidden: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        asked.append(hidden.size(0))
        return real(hidden, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_output, "hidden_logprobs", spy)
    runs = []
    for scored in (None, mask):
        model.zero_grad()
        lp = token_logprobs(model, ids, 0.7, [0, 11, 24], fused=fused, scored=scored)
        (lp * weights).sum().backward()
        runs.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (whole, whole_grads), (got, got_grads) = runs
    assert asked == ([24, 8] if fused else [])
    assert (got[mask == 0] == 0).all() and (whole[mask == 0] != 0).sum() > 10
    torch.testing.assert_close(got[mask == 1], whole[mask == 1], atol=1e-5, rtol=1e-5)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
