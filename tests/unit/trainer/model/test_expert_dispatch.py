"""The alltoall dispatcher's chunk regrouping as one gather equals megatron's split-and-cat,
values and gradients, with empty chunks; building a grouped-experts model installs it."""

from __future__ import annotations

import torch

from services.trainer.model.expert_dispatch import sort_chunks_by_index, use_index_sorted_chunks


def test_one_gather_equals_megatrons_split_and_cat() -> None:
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    g = torch.Generator().manual_seed(0)
    # 3 source ranks x 4 local experts, rank-major in, expert-major out (and back)
    sizes = torch.tensor([3, 0, 2, 5, 1, 4, 0, 2, 6, 1, 1, 0])
    expert_major = torch.arange(12).view(3, 4).T.ravel()
    x = torch.randn(int(sizes.sum()), 8, generator=g, requires_grad=True)
    probs = torch.rand(int(sizes.sum()), generator=g, requires_grad=True)
    ours, our_probs = sort_chunks_by_index(x, sizes, expert_major, probs)
    ref, ref_probs = sort_chunks_by_idxs(x, sizes, expert_major, probs)
    assert our_probs is not None and ref_probs is not None
    assert torch.equal(ours, ref) and torch.equal(our_probs, ref_probs)
    up, up_p = torch.randn(ref.shape, generator=g), torch.randn(ref_probs.shape, generator=g)
    ours_grads = torch.autograd.grad((ours * up).sum() + (our_probs * up_p).sum(), (x, probs))
    ref_grads = torch.autograd.grad((ref * up).sum() + (ref_probs * up_p).sum(), (x, probs))
    for a, b in zip(ours_grads, ref_grads, strict=True):
        assert torch.equal(a, b)
    # and back: the combine's inverse order restores the input
    back_sizes = sizes.view(3, 4).T.ravel()
    rank_major = torch.arange(12).view(4, 3).T.ravel()
    restored, _ = sort_chunks_by_index(ours, back_sizes, rank_major)
    assert torch.equal(restored, x)


def test_the_dispatcher_module_uses_it_once_installed() -> None:
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    original = token_dispatcher.sort_chunks_by_idxs  # ours already, where a model was built
    try:
        use_index_sorted_chunks()
        x = torch.arange(6.0).view(6, 1)
        out, _ = token_dispatcher.sort_chunks_by_idxs(x, torch.tensor([2, 4]),
                                                      torch.tensor([1, 0]))
        assert out.ravel().tolist() == [2.0, 3.0, 4.0, 5.0, 0.0, 1.0]
        assert token_dispatcher.sort_chunks_by_idxs is not sort_chunks_by_idxs
    finally:
        token_dispatcher.sort_chunks_by_idxs = original
