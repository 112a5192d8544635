"""Packed attention's kernel grouping (fused_attention.py) against one SDPA call per
sequence."""

from __future__ import annotations

import torch

from services.trainer.attention import fused_attention


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
