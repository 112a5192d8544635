"""GLM-5's DeepSeek Sparse Attention in megatron on one gloo rank: with a top-k far below the
row length (and layers that share an earlier layer's indices) the log-probs equal Hugging
Face's; dense attention, or indices recomputed on shared layers, do not."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.common.errors import ConfigError
from services.common.ports import free_port
from services.testing.hf_models import random_hf_model, reference_logprobs
from services.trainer.attention import sparse_attention
from services.trainer.model.model import ModelShape, build_gpt_model
from services.trainer.model_config import ParallelConfig
from services.trainer.objective.logprobs import token_logprobs
from services.trainer.parallel.parallel import init_parallel, teardown_parallel
from services.trainer.weights.convert import load_hf_weights

INDEX_TOPK = 8


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    teardown_parallel()


@pytest.fixture(scope="module")
def converted() -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """HF and megatron GLM-5 (layers full, shared, full, shared), two rows of 37 tokens and
    HF's log-probs of them."""
    hf = random_hf_model("glm_moe_dsa", num_layers=4, num_kv_heads=4, index_topk=INDEX_TOPK,
                         index_n_heads=8)
    assert hf.config.indexer_types == ["full", "shared", "full", "shared"]
    shape = ModelShape.from_hf(hf.config)
    model = build_gpt_model(shape)
    load_hf_weights(model, shape, hf.state_dict())
    ids = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(3))
    return hf, model, ids, reference_logprobs(hf, ids)


def _attentions(model: Any) -> list[Any]:
    return [layer.self_attention for layer in model.decoder.layers]


def test_sparse_logprobs_match_hf_and_gradients_flow(converted: Any) -> None:
    hf, model, ids, ref = converted
    ours = token_logprobs(model, ids)
    torch.testing.assert_close(ours.detach(), ref, atol=1e-4, rtol=0)
    # The selection matters: the same weights with every earlier token selected differ.
    for module in hf.modules():
        if type(module).__name__ == "GlmMoeDsaIndexer":
            module.index_topk = ids.shape[1]
    try:
        assert (reference_logprobs(hf, ids) - ref).abs().max() > 0.5
    finally:
        for module in hf.modules():
            if type(module).__name__ == "GlmMoeDsaIndexer":
                module.index_topk = INDEX_TOPK
    ours[:, 1:].sum().backward()
    trainable = {n: p for n, p in model.named_parameters() if ".local_experts." not in n}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert not any(".indexer." in n for n, p in model.named_parameters())  # frozen buffers
    model.zero_grad()


def test_padding_to_the_right_changes_nothing(converted: Any) -> None:
    hf, model, ids, _ = converted
    with torch.no_grad():
        short = token_logprobs(model, ids[:, :23])
        full = token_logprobs(model, ids)
    torch.testing.assert_close(full[:, :23], short, atol=1e-5, rtol=0)
    torch.testing.assert_close(short, reference_logprobs(hf, ids[:, :23]), atol=1e-4, rtol=0)


def test_indexer_in_query_chunks_selects_the_same(
    converted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model, ids, ref = converted
    monkeypatch.setattr(sparse_attention, "_SCORE_BUDGET", 2 * 8 * 37 * 5)  # 5 queries a chunk
    with torch.no_grad():
        chunked = token_logprobs(model, ids)
    torch.testing.assert_close(chunked, ref, atol=1e-4, rtol=0)


def _dense(attention: Any, hidden: torch.Tensor, q_latent: torch.Tensor) -> None:
    return None


def test_dense_attention_or_recomputed_indices_are_caught(
    converted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model, ids, ref = converted
    attentions = _attentions(model)
    with monkeypatch.context() as patch:
        patch.setattr(type(attentions[0]), "_topk", _dense)
        with torch.no_grad():
            dense = token_logprobs(model, ids)
    assert (dense - ref).abs().max() > 0.5
    with monkeypatch.context() as patch:  # shared layers run the full layer's indexer anew
        patch.setattr(attentions[1], "indexer", attentions[0].indexer)
        patch.setattr(attentions[3], "indexer", attentions[2].indexer)
        with torch.no_grad():
            recomputed = token_logprobs(model, ids)
    assert (recomputed - ref).abs().max() > 0.05


def test_stages_must_start_at_an_indexer_layer() -> None:
    hf = random_hf_model("glm_moe_dsa", num_layers=2, num_kv_heads=4, index_topk=INDEX_TOPK)
    shape = ModelShape.from_hf(hf.config)
    with pytest.raises(ConfigError, match="indexer layer"):
        build_gpt_model(dataclasses.replace(shape, indexer_layers=(1,)))
