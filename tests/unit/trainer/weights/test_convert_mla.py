"""GLM-5 (glm_moe_dsa) and DeepSeek-V3 in megatron on one gloo rank: MLA, sigmoid routing with
expert bias and dense first layers match Hugging Face; DSA indexers and the MTP layer round
trip (test_sparse_attention.py runs rows longer than the indexer's top-k)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.common.ports import free_port
from services.testing.hf_models import random_hf_model, reference_logprobs
from services.trainer.model.model import ModelShape, build_gpt_model
from services.trainer.model.model_mla import MLAShape
from services.trainer.model_config import ParallelConfig
from services.trainer.objective.logprobs import forward_logits, token_logprobs
from services.trainer.parallel.parallel import init_parallel, teardown_parallel
from services.trainer.weights import weight_map
from services.trainer.weights.convert import iter_hf_tensors, load_hf_weights
from services.trainer.weights.weight_map_mla import MTP_PREFIX, carried_rules

INDEX_TOPK = 32  # hf_models' glm_moe_dsa


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    teardown_parallel()


def _with_mtp(shape: MLAShape, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`hf_state` plus random MTP-layer tensors (transformers does not build that layer)."""
    state = weight_map.checkpoint_state(shape, hf_state)
    gen = torch.Generator().manual_seed(7)
    for rule in carried_rules(shape):
        if rule.mcore.startswith(MTP_PREFIX):
            full = torch.randn(rule.full_shape, generator=gen)
            state.update(zip(rule.hf, weight_map.unfuse(rule, shape, full), strict=True))
    return state


def _converted(arch: str, **kwargs: Any) -> tuple[Any, Any, MLAShape, dict[str, torch.Tensor]]:
    hf = random_hf_model(arch, num_layers=3, num_kv_heads=4, **kwargs)
    shape = ModelShape.from_hf(hf.config)
    assert isinstance(shape, MLAShape)
    state = _with_mtp(shape, hf.state_dict())
    model = build_gpt_model(shape)
    load_hf_weights(model, shape, state)
    return hf, model, shape, state


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v3"])
def test_logits_and_logprobs_match_hf(arch: str) -> None:
    hf, model, shape, _ = _converted(arch)
    assert shape.is_mla and shape.moe_layers == (False, True, True)
    ids = torch.randint(0, 96, (2, INDEX_TOPK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = forward_logits(model, ids)
        logprobs = token_logprobs(model, ids)
    assert ref.abs().max() > 3  # peaked distributions: a wrong layout cannot hide
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logprobs, reference_logprobs(hf, ids), atol=1e-4, rtol=0)
    token_logprobs(model, ids[:, :8]).sum().backward()
    dense = [p for n, p in model.named_parameters() if ".local_experts." not in n]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in dense)


def _deinterleave_rope(rule: Any, shape: Any, parts: list[torch.Tensor]) -> torch.Tensor:
    """A plausible mistake: de-interleave the rotary rows that megatron de-interleaves itself."""
    full = _FUSE(rule, shape, parts)
    rope = shape.qk_rope_head_dim
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if rule.mcore.endswith("linear_kv_down_proj.weight"):
        full = torch.cat([full[:-rope], full[-rope:][order]])
    if rule.mcore.endswith("linear_q_up_proj.weight"):
        heads = full.reshape(shape.num_heads, -1, full.shape[-1])
        full = torch.cat([heads[:, :-rope], heads[:, -rope:][:, order]], dim=1).reshape(full.shape)
    return full


_FUSE = weight_map.fuse


def _zero_expert_bias(rule: Any, shape: Any, parts: list[torch.Tensor]) -> torch.Tensor:
    full = _FUSE(rule, shape, parts)
    return torch.zeros_like(full) if rule.mcore.endswith("router.expert_bias") else full


@pytest.mark.parametrize("wrong_fuse", [_deinterleave_rope, _zero_expert_bias])
def test_wrong_conversion_is_caught(monkeypatch: pytest.MonkeyPatch, wrong_fuse: Any) -> None:
    monkeypatch.setattr(weight_map, "fuse", wrong_fuse)
    hf, model, _, _ = _converted("glm_moe_dsa")
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (token_logprobs(model, ids) - reference_logprobs(hf, ids)).abs().max()
    assert diff > 0.1


def test_round_trip_carries_indexers_and_mtp() -> None:
    hf, model, shape, original = _converted("glm_moe_dsa", num_nextn_predict_layers=1)
    assert shape.num_mtp_layers == 1 and shape.indexer_layers == (0, 2)
    back = dict(iter_hf_tensors(model, shape))
    assert list(back) == [n for r in weight_map.tensor_rules(shape) for n in r.hf]
    assert set(back) == set(original)
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name
    assert "model.layers.0.self_attn.indexer.wq_b.weight" in back
    assert not any(n.startswith("model.layers.1.self_attn.indexer.") for n in back)  # shared
    assert "model.layers.3.eh_proj.weight" in back
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in back
    carried = {r.mcore for r in carried_rules(shape)}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert carried and not carried & trainable
    assert carried <= set(model.state_dict())  # checkpointed with the model
