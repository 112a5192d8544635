"""rope.py's RoPE against megatron-core's own (its THD per-sequence loop and its padded-row
form), bit for bit with gradients, and its tables computed once per rotary tensor."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from services.trainer.attention import rope


class _OneRank:
    """A context-parallel group of one rank (what megatron's reference asks of it)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _freqs(max_len: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]  # megatron's layout


def test_positions_restart_in_every_sequence() -> None:
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    got = rope.thd_positions(cu, torch.device("cpu"))
    assert got.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("bounds", [[0, 5, 16, 19], [0, 7], [0, 1, 2, 40, 41]])
def test_rope_thd_equals_megatron_loop(bounds: list[int], interleaved: bool) -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    gen = torch.Generator().manual_seed(len(bounds))
    cu = torch.tensor(bounds, dtype=torch.int32)
    t = torch.randn(bounds[-1], 3, 16, generator=gen, requires_grad=True)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    freqs = _freqs(longest, 16)
    want = _apply_rotary_pos_emb_thd(t, cu, freqs, rotary_interleaved=interleaved,
                                     cp_group=_OneRank())  # fmt: skip
    got = rope.rope_thd(t, cu, freqs, rotary_interleaved=interleaved)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    weights = torch.randn(want.shape, generator=gen)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), t)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), t)
    torch.testing.assert_close(got_grad, want_grad, atol=0, rtol=0)


def test_routed_rope_keeps_megatron_for_padded_rows() -> None:
    from megatron.core.transformer import attention

    rope.install()
    rope.install()  # idempotent: routes once
    routed = attention.apply_rotary_pos_emb
    assert not hasattr(routed.routed_from, "routed_from")


def _megatron_config(interleaved: bool = False) -> Any:
    return SimpleNamespace(
        apply_rope_fusion=False,
        rotary_interleaved=interleaved,
        multi_latent_attention=False,
        mrope_section=None,
    )


def _assert_same_with_grads(got_fn: Any, want_fn: Any, t: torch.Tensor) -> None:
    want, got = want_fn(t), got_fn(t)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(3)).to(t.dtype)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), t)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), t)
    torch.testing.assert_close(got_grad, want_grad, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "rot_dim", "mscale"), [(16, 16, 1.0), (16, 8, 1.0), (8, 8, 0.7)])
def test_padded_rows_equal_megatron(dtype: torch.dtype, dim: int, rot_dim: int,
                                    mscale: float) -> None:  # fmt: skip
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    gen = torch.Generator().manual_seed(dim + rot_dim)
    t = torch.randn(11, 2, 3, dim, generator=gen).to(dtype).requires_grad_()
    freqs = _freqs(11, rot_dim)
    _assert_same_with_grads(
        lambda x: rope.rope_bshd(x, freqs, mscale),
        lambda x: _apply_rotary_pos_emb_bshd(x, freqs, mscale=mscale),
        t,
    )


def test_routed_rope_covers_padded_and_packed_rows_and_hands_back_the_rest() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    routed = rope._routed(rope_utils.apply_rotary_pos_emb)
    gen = torch.Generator().manual_seed(5)
    freqs = _freqs(9, 8)
    padded = torch.randn(9, 2, 3, 8, generator=gen, requires_grad=True)
    _assert_same_with_grads(
        lambda x: routed(x, freqs, _megatron_config()),
        lambda x: rope_utils._apply_rotary_pos_emb_bshd(x, freqs),
        padded,
    )
    # interleaved rotation is megatron's: this module's rotation would give another tensor
    _assert_same_with_grads(
        lambda x: routed(x, freqs, _megatron_config(interleaved=True), cp_group=_OneRank()),
        lambda x: rope_utils._apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=True),
        padded,
    )
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    packed = torch.randn(9, 3, 8, generator=gen, requires_grad=True)
    _assert_same_with_grads(
        lambda x: routed(x, freqs, _megatron_config(), cu, cp_group=_OneRank()),
        lambda x: rope_utils._apply_rotary_pos_emb_thd(x, cu, freqs, cp_group=_OneRank()),
        packed,
    )


def test_tables_are_computed_once_per_rotary_tensor() -> None:
    freqs = _freqs(6, 8)
    cos, sin = rope._tables(freqs, torch.float32, 1.0)
    again = rope._tables(freqs, torch.float32, 1.0)
    assert again[0] is cos and again[1] is sin  # the next layer of the same forward
    assert rope._tables(freqs, torch.bfloat16, 1.0)[0].dtype == torch.bfloat16
    freqs.mul_(2.0)  # the same tensor changed in place: new tables
    changed, _ = rope._tables(freqs, torch.float32, 1.0)
    torch.testing.assert_close(changed, torch.cos(freqs))
    other = _freqs(6, 8) * 3.0  # another tensor, never the first one's tables
    torch.testing.assert_close(rope._tables(other, torch.float32, 1.0)[0], torch.cos(other))
