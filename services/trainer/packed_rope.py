"""Rotary embeddings of packed (THD) rows in one gather and one rotation, whatever the count.

megatron-core's unfused THD RoPE (`rope_utils._apply_rotary_pos_emb_thd`, what runs without
TransformerEngine's fused kernel) splits the packed tensor at every sequence boundary and
concatenates one slice of the frequency table per sequence, in every attention layer for
queries and keys alike: Python work and small kernels that grow with the number of sequences.
Here each token's position inside its sequence (`thd_positions`: token index minus its
sequence's start, from `cu_seqlens`) indexes the table once, computed once per batch and
device, and the rotation runs over the whole packed tensor at once. The result is the same
tensor (tests/unit/trainer/test_packed_rope.py holds it against megatron's loop).

`install()` routes megatron's attention to `apply_rotary_pos_emb` here; it hands everything
that is not a plain THD row (right-padded rows, TE's fused RoPE, context parallelism, whose
per-rank halves megatron slices itself) back to megatron's function unchanged.
Called by model.py when it builds a model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_positions: dict[tuple[Any, ...], Tensor] = {}  # recent batches' positions, by device


def thd_positions(cu_seqlens: Tensor, device: torch.device) -> Tensor:
    """Each token's position in its own sequence [T] (int64 on `device`) for boundaries
    `cu_seqlens` (0, len0, len0+len1, ...)."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    key = (device, *bounds)
    if key not in _positions:
        if len(_positions) > 16:
            _positions.clear()
        starts = torch.tensor(bounds[:-1], dtype=torch.long)
        lengths = torch.tensor(bounds[1:], dtype=torch.long) - starts
        tokens = torch.arange(bounds[-1] - bounds[0], dtype=torch.long)
        _positions[key] = (tokens + bounds[0] - starts.repeat_interleave(lengths)).to(device)
    return _positions[key]


def rope_thd(
    t: Tensor, cu_seqlens: Tensor, freqs: Tensor, rotary_interleaved: bool = False,
    multi_latent_attention: bool = False, mscale: float = 1.0,
) -> Tensor:
    """RoPE of packed [T, heads, dim] `t` with the table `freqs` [max_s, 1, 1, rot_dim] (or
    one entry per packed token, megatron's exact-offset form), positions restarting at 0 in
    each sequence."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    if freqs.size(0) != int(cu_seqlens[-1]):
        freqs = freqs.index_select(0, thd_positions(cu_seqlens, freqs.device))
    return _apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), freqs, rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention, mscale=mscale,
    ).squeeze(1)  # fmt: skip


def _routed(original: Any) -> Any:
    def apply_rotary_pos_emb(
        t: Tensor, freqs: Tensor, config: Any, cu_seqlens: Tensor | None = None,
        mscale: float = 1.0, cp_group: Any = None,
    ) -> Tensor:
        if (cu_seqlens is None or config.apply_rope_fusion or cp_group is None
                or cp_group.size() != 1):
            return original(t, freqs, config, cu_seqlens, mscale, cp_group)  # type: ignore[no-any-return]
        return rope_thd(t, cu_seqlens, freqs, config.rotary_interleaved,
                        config.multi_latent_attention, mscale)  # fmt: skip

    apply_rotary_pos_emb.routed_from = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def install() -> None:
    """Point megatron's attention at this module's THD RoPE (idempotent)."""
    from megatron.core.transformer import attention

    if not hasattr(attention.apply_rotary_pos_emb, "routed_from"):
        attention.apply_rotary_pos_emb = _routed(attention.apply_rotary_pos_emb)
