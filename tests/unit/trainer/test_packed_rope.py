"""packed_rope.py's THD RoPE against megatron-core's per-sequence loop, and packed
attention's kernel grouping (fused_attention.py) against one SDPA call per sequence."""

from __future__ import annotations

import pytest
import torch

from services.trainer import fused_attention, packed_rope


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
    got = packed_rope.thd_positions(cu, torch.device("cpu"))
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
    got = packed_rope.rope_thd(t, cu, freqs, rotary_interleaved=interleaved)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    weights = torch.randn(want.shape, generator=gen)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), t)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), t)
    torch.testing.assert_close(got_grad, want_grad, atol=0, rtol=0)


def test_routed_rope_keeps_megatron_for_padded_rows() -> None:
    from megatron.core.transformer import attention

    packed_rope.install()
    packed_rope.install()  # idempotent: routes once
    routed = attention.apply_rotary_pos_emb
    assert not hasattr(routed.routed_from, "routed_from")


def test_segments_batch_equal_lengths_and_share_varlen() -> None:
    low = fused_attention.SDPA_MIN_TOKENS - 1
    big = fused_attention.SDPA_MIN_TOKENS
    lengths = [big, big, big + 1, low, low - 3, big]
    assert fused_attention._segments(lengths, varlen=True) == [
        (0, 2, big), (2, 1, big + 1), (3, 2, 0), (5, 1, big)]  # fmt: skip
    assert fused_attention._segments([4, 4, 2], varlen=False) == [(0, 2, 4), (2, 1, 2)]


def test_packed_attention_equals_sdpa_per_sequence() -> None:
    gen = torch.Generator().manual_seed(0)
    bounds = [0, 6, 12, 15, 22]
    q = torch.randn(22, 4, 8, generator=gen)
    k, v = torch.randn(22, 2, 8, generator=gen), torch.randn(22, 2, 8, generator=gen)
    got = fused_attention.packed_causal(q, k, v, torch.tensor(bounds), 7, 0.3)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        one = [x[a:b].transpose(0, 1)[None] for x in (q, k, v)]
        want = fused_attention.causal_sdpa(*one, 0.3)[0].transpose(0, 1)
        torch.testing.assert_close(got[a:b], want, atol=1e-6, rtol=1e-5)
