"""Shared-prefix rows: what a group shares, how its samples are cut into micro-batches, and
that a megatron model scores them as it scores the samples whole (log-probs and gradients)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services._proto.riptide.v1.common_pb2 import VERDICT_STATUS_SCORED, Group, Trajectory
from services.common.ports import free_port
from services.testing.hf_models import random_hf_model
from services.trainer.attention import shared_prefix
from services.trainer.config import TrainerConfig
from services.trainer.data.batch import MicroBatch, pack_groups
from services.trainer.data.lockstep import pad_micro_batch
from services.trainer.model.model import ModelShape, build_gpt_model
from services.trainer.model_config import ParallelConfig
from services.trainer.objective.logprobs import token_logprobs
from services.trainer.parallel.parallel import init_parallel, teardown_parallel
from services.trainer.weights.convert import load_hf_weights


def test_shareable_len_stops_before_the_first_difference_or_loss_token() -> None:
    ids = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 5, 7]]
    loss_free = [[0] * len(r) for r in ids]
    assert shared_prefix.shareable_len(ids, loss_free) == 3  # common 4, less the last
    masks = [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0] * 6]
    assert shared_prefix.shareable_len(ids, masks) == 1  # a loss token ends the shared part
    assert shared_prefix.shareable_len(ids[:1], loss_free[:1]) == 0  # nothing to share with
    assert shared_prefix.shareable_len([[1, 2], [3, 2]], [[0, 0], [0, 0]]) == 0


def test_positions_go_on_from_the_prefix() -> None:
    bounds, prefix_of = [0, 3, 5, 9, 11], [-1, 0, 0, -1]
    got = shared_prefix.positions(bounds, prefix_of).tolist()
    assert got == [0, 1, 2, 3, 4, 3, 4, 5, 6, 0, 1]
    assert shared_prefix.longest_context(bounds, prefix_of) == 7


@pytest.mark.parametrize("prefix_of", [[-1, 1], [-1, 0, 1], [0, -1]])
def test_layouts_whose_prefix_is_not_an_earlier_root_are_refused(prefix_of: list[int]) -> None:
    bounds = list(range(len(prefix_of) + 1))
    with pytest.raises(ValueError, match="continues"):
        shared_prefix.check_layout(bounds, prefix_of)


def _group(group_id: str, prompt: list[int], responses: list[list[int]]) -> Group:
    return Group(group_id=group_id, samples=[
        Trajectory(prompt_ids=prompt, response_ids=r, loss_mask=[1] * len(r),
                   rollout_logprobs=[-0.1 * (j + 1) for j in range(len(r))],
                   reward=float(i % 2), status=VERDICT_STATUS_SCORED)
        for i, r in enumerate(responses)])  # fmt: skip


def _samples_of(mb: MicroBatch) -> list[tuple[list[int], list[float], list[float], float]]:
    """The whole samples a micro-batch holds: ids, loss mask, log-probs, advantage (prefix
    rows put back in front of their continuations)."""
    assert mb.cu_seqlens is not None
    prefix_of = mb.prefix_of or [-1] * (len(mb.cu_seqlens) - 1)
    parents = set(prefix_of)
    cols = [mb.input_ids[0], mb.loss_mask[0], mb.rollout_logprobs[0], mb.advantages[0]]
    seqs = [[c[a:b] for c in cols] for a, b in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:],
                                                   strict=True)]  # fmt: skip
    out = []
    for i, parent in enumerate(prefix_of):
        if i in parents:
            continue
        parts = seqs[i] if parent < 0 else [torch.cat(p) for p in zip(seqs[parent], seqs[i],
                                                                    strict=True)]  # fmt: skip
        adv = parts[3][-1].item()
        out.append((parts[0].tolist(), parts[1].tolist(), parts[2].tolist(), adv))
    return out


def test_pack_shares_each_groups_prompt_and_keeps_every_sample_whole() -> None:
    groups = [("1-0", _group("a", [5, 6, 7, 8], [[1, 2], [3], [1, 4, 4], [9, 9, 9, 9]])),
              ("2-0", _group("b", [5, 6, 2], [[7], [8, 8]]))]  # fmt: skip
    plain = pack_groups(groups, True, 12, packed=True)
    shared = pack_groups(groups, True, 12, packed=True, shared_prefix=True)
    assert shared.num_tokens == plain.num_tokens and shared.num_samples == plain.num_samples
    assert shared.num_loss_tokens == plain.num_loss_tokens
    computed = sum(mb.input_ids.shape[1] for mb in shared.micro_batches)
    assert computed < sum(mb.input_ids.shape[1] for mb in plain.micro_batches)
    assert all(mb.input_ids.shape[1] <= 12 for mb in shared.micro_batches)

    def whole(batch: Any) -> list[Any]:
        return sorted(s for mb in batch.micro_batches for s in _samples_of(mb))

    assert whole(shared) == whole(plain)
    for mb in shared.micro_batches:  # every continuation starts with a loss-free token
        for i, parent in enumerate(mb.prefix_of or []):
            assert mb.cu_seqlens is not None
            assert parent < 0 or mb.loss_mask[0, mb.cu_seqlens[i]] == 0


def test_a_group_larger_than_the_budget_repeats_its_prefix_per_micro_batch() -> None:
    groups = [("1-0", _group("a", list(range(10, 20)), [[1] * 4, [2] * 4, [3] * 4, [4] * 4]))]
    batch = pack_groups(groups, True, 20, packed=True, shared_prefix=True)
    assert [mb.input_ids.shape[1] for mb in batch.micro_batches] == [19, 19]
    assert [mb.prefix_of for mb in batch.micro_batches] == [[-1, 0, 0], [-1, 0, 0]]


def test_lockstep_padding_adds_a_sequence_that_continues_nothing() -> None:
    batch = pack_groups([("1-0", _group("a", [5, 6, 7], [[1], [2]]))], True, 50, packed=True,
                        shared_prefix=True)  # fmt: skip
    (mb,) = batch.micro_batches
    padded = pad_micro_batch(mb, 1, mb.input_ids.shape[1] + 3)
    assert padded.prefix_of == [-1, 0, 0, -1] and padded.cu_seqlens is not None
    shared_prefix.check_layout(padded.cu_seqlens, padded.prefix_of)


def test_config_refuses_shared_prefix_without_packed_fused_rows() -> None:
    with pytest.raises(ValueError, match="shared_prefix needs packed_sequences"):
        TrainerConfig(shared_prefix=True)
    with pytest.raises(ValueError, match="shared_prefix needs"):
        TrainerConfig(shared_prefix=True, packed_sequences=True,
                      parallel=ParallelConfig(pipeline_parallel=2))  # fmt: skip
    assert TrainerConfig(shared_prefix=True, packed_sequences=True).shared_prefix


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    init_parallel(ParallelConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    teardown_parallel()


@pytest.mark.parametrize("fused_output", [False, True])
def test_shared_prefix_rows_score_like_whole_rows(one_rank: None, fused_output: bool) -> None:
    """Two groups' samples (GQA model): the shared-prefix micro-batch gives every sample's
    tokens the log-probs and the model the gradients of the samples run one by one."""
    hf = random_hf_model("qwen2", num_layers=2, num_heads=4, num_kv_heads=2)
    shape = ModelShape.from_hf(hf.config)
    model = build_gpt_model(shape, dtype="float32", attention="fused")
    load_hf_weights(model, shape, hf.state_dict())
    gen = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, 96, (n,), generator=gen).tolist()

    groups = [("1-0", _group("a", tokens(9), [tokens(n) for n in (4, 7, 1)])),
              ("2-0", _group("b", tokens(5), [tokens(n) for n in (3, 6)]))]  # fmt: skip
    (mb,) = pack_groups(groups, True, 100, packed=True, shared_prefix=True).micro_batches
    assert mb.prefix_of is not None and mb.prefix_of.count(-1) == 2
    got = token_logprobs(model, mb.input_ids, 0.8, mb.cu_seqlens, fused_output, mb.prefix_of)
    weights = torch.randn(mb.input_ids.shape, generator=gen) * mb.loss_mask
    (got * weights).sum().backward()
    shared_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    assert mb.cu_seqlens is not None
    bounds, loss = mb.cu_seqlens, torch.zeros(())
    for i, parent in enumerate(mb.prefix_of):
        if parent < 0 and i in mb.prefix_of:
            continue  # a prefix: scored with each continuation below
        a, b = bounds[i], bounds[i + 1]
        pa, pb = (bounds[parent], bounds[parent + 1]) if parent >= 0 else (a, a)
        whole = torch.cat((mb.input_ids[0, pa:pb], mb.input_ids[0, a:b]))[None]
        want = token_logprobs(model, whole, 0.8, fused=fused_output)[0, pb - pa :]
        scored = mb.loss_mask[0, a:b] > 0
        torch.testing.assert_close(got[0, a:b][scored], want[scored], atol=2e-5, rtol=0)
        loss = loss + (want * weights[0, a:b]).sum()
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(shared_grads[name], p.grad, atol=2e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")  # type: ignore[misc]
