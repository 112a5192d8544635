"""HF <-> megatron conversion on one gloo rank: parity of logits and log-probs, round trips."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.common.ports import free_port
from services.testing.hf_models import random_hf_model, reference_logprobs
from services.trainer.model.model import ModelShape, build_gpt_model
from services.trainer.model_config import ParallelConfig
from services.trainer.objective.logprobs import forward_logits, token_logprobs
from services.trainer.parallel.parallel import init_parallel, teardown_parallel
from services.trainer.weights import weight_map
from services.trainer.weights.convert import (
    iter_hf_buckets,
    iter_hf_tensors,
    load_hf_weights,
    merge,
    shard,
)


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    teardown_parallel()


def _converted(arch: str, **kwargs: Any) -> tuple[Any, Any, ModelShape]:
    hf = random_hf_model(arch, **kwargs)
    shape = ModelShape.from_hf(hf.config)
    model = build_gpt_model(shape)
    load_hf_weights(model, shape, hf.state_dict())
    return hf, model, shape


@pytest.mark.parametrize(
    ("arch", "tied"),
    [("llama", False), ("qwen2", True), ("qwen3", False), ("qwen2_moe", False),
     ("qwen3_moe", False), ("mixtral", False)],
)
def test_logits_and_logprobs_match_hf(arch: str, tied: bool) -> None:
    hf, model, _ = _converted(arch, tie_word_embeddings=tied)
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = forward_logits(model, ids)
        logprobs = token_logprobs(model, ids)
    assert ref.abs().max() > 3  # peaked distributions: a wrong layout cannot hide
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logprobs, reference_logprobs(hf, ids), atol=1e-4, rtol=0)


def test_llama3_rope_scaling_matches_hf() -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf, model, shape = _converted("llama", rope_parameters=rope)
    assert shape.rope_scaling_factor == 8.0
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, ids), reference_logprobs(hf, ids),
                                   atol=1e-4, rtol=0)


def _qkv_stacked(shape: ModelShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return torch.cat([q, k, v])  # [Q; K; V]: wrong, megatron groups by query group


def test_wrong_qkv_layout_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_map, "fuse_qkv", _qkv_stacked)
    hf, model, _ = _converted("llama")
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (token_logprobs(model, ids) - reference_logprobs(hf, ids)).abs().max()
    assert diff > 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe", "mixtral"])
def test_round_trip_hf_megatron_hf(arch: str) -> None:
    hf, model, shape = _converted(arch, tie_word_embeddings=arch == "qwen2")
    original = weight_map.checkpoint_state(shape, hf.state_dict())
    back = dict(iter_hf_tensors(model, shape))
    assert list(back) == [n for r in weight_map.tensor_rules(shape) for n in r.hf]
    tied = {"lm_head.weight"} if shape.tie_word_embeddings else set()
    assert set(back) == set(original) - tied
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name


def test_buckets_respect_size_and_order() -> None:
    _, model, shape = _converted("llama")
    flat = list(iter_hf_tensors(model, shape, torch.bfloat16))
    buckets = list(iter_hf_buckets(model, shape, bucket_mb=0.02, dtype=torch.bfloat16))
    assert len(buckets) > 2
    assert [n for b in buckets for n, _ in b] == [n for n, _ in flat]
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert len(bucket) == 1 or size <= 0.02 * 2**20
        assert all(t.dtype == torch.bfloat16 for _, t in bucket)


@pytest.mark.parametrize("kind", ["column", "row", "vocab", "qkv", "fc1"])
def test_shard_then_merge_is_identity(kind: str) -> None:
    rule = weight_map.TensorRule("x", ("x",), kind, (8, 6))  # type: ignore[arg-type]
    full = torch.randn(8, 6)
    shards = [shard(rule, full, r, 2) for r in range(2)]
    assert all(s.numel() == full.numel() // 2 for s in shards)
    assert torch.equal(merge(rule, shards), full)


def test_fc1_shards_hold_gate_and_up_halves() -> None:
    rule = weight_map.TensorRule("x", ("g", "u"), "fc1", (8, 2))
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    full = weight_map.fuse(rule, None, [gate, up])  # type: ignore[arg-type]
    assert torch.equal(shard(rule, full, 1, 2), torch.cat([gate[2:], up[2:]]))


def test_packed_logprobs_and_grads_equal_padded() -> None:
    """One THD row of three sequences (fused attention's document mask, per-sequence RoPE)
    gives each sequence's own log-probs and the same gradients as the rows run one by one."""
    _, model, _ = _converted("llama")
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 96, (n,), generator=gen) for n in (5, 11, 3)]
    weights = torch.randn(19, generator=gen)
    cu = [0, 5, 16, 19]
    got = token_logprobs(model, torch.cat(seqs)[None], cu_seqlens=cu)[0]
    (got * weights).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = torch.cat([token_logprobs(model, s[None])[0] for s in seqs])
    (want * weights).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert got[0] == 0 and got[5] == 0 and got[16] == 0
    for p, packed in zip(model.parameters(), packed_grads, strict=True):
        # fp32 rounding of other summation orders, at the gradient's scale (about 10 here)
        assert float((packed - p.grad).abs().max()) <= 1e-4 * float(p.grad.abs().max())


def test_logprobs_carry_gradients() -> None:
    _, model, _ = _converted("llama")
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    token_logprobs(model, ids).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_dense_models_tensors_come_in_the_order_transformers_keeps_them(arch: str) -> None:
    """The engine lays its parameters out in state_dict order (engine/flat_weights.py): a
    staged bucket in that order loads there as one copy."""
    hf = random_hf_model(arch)
    shape = ModelShape.from_hf(hf.config)
    ours = [n for r in weight_map.tensor_rules(shape) for n in r.hf]
    assert ours == [n for n in hf.state_dict() if n != "lm_head.weight" or
                    not shape.tie_word_embeddings]
