"""Rotary embeddings for megatron's attention: the cos/sin tables once a forward, one rotation.

megatron-core's unfused RoPE (what runs without TransformerEngine's fused kernel) computes
`cos(freqs)` and `sin(freqs)`, scales and casts them in every attention layer, for queries
and keys alike, then rotates with about ten elementwise kernels; its THD form (packed rows)
also splits the tensor at every sequence boundary and concatenates one slice of the table per
sequence. Those small kernels were a fifth of a GPU step's launches (the packed 0.5B step on
an H200: 15,527 kernels and copies with megatron's per-layer tables, 12,071 with these). Here:
- the tables `cos`/`sin` (in the activations' dtype, times `mscale`) are computed once per
  rotary tensor megatron passes to the layers (one per forward, `_tables`), for packed rows
  after one gather of each token's position in its own sequence (`thd_positions`; a
  continuation of a shared prefix goes on from the prefix's positions); inside a compiled
  layer a padded row's tables are part of the layer's graph instead, fused into the rotation;
- the rotation `t * cos + rotate_half(t) * sin` is one function, compiled on CUDA by
  torch.compile into one kernel forward and one backward (`_rotate_fused`), eager elsewhere,
  where it is megatron's arithmetic operation for operation (the same tensor: tests in
  tests/unit/trainer/attention/test_rope.py hold it against megatron's loop, bit for bit).

`install()` routes megatron's attention to `apply_rotary_pos_emb` here; it hands back to
megatron's function whatever it does not cover: interleaved rotation, MLA's layout, TE's
fused RoPE, context parallelism (whose per-rank halves megatron slices itself).
Called by model.py when it builds a model.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from services.common.errors import ConfigError
from services.trainer.attention import shared_prefix

_positions: dict[tuple[Any, ...], Tensor] = {}  # recent batches' positions, by device
_TABLES_KEPT = 8
_tables_cache: dict[tuple[Any, ...], tuple[Any, int, Tensor, Tensor]] = {}


def thd_positions(cu_seqlens: Tensor, device: torch.device) -> Tensor:
    """Each token's position in its own sequence [T] (int64 on `device`) for boundaries
    `cu_seqlens` (0, len0, len0+len1, ...); a sequence continuing a shared prefix goes on
    from the prefix's length (shared_prefix.py)."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    prefix_of = shared_prefix.layout_of(cu_seqlens) or (-1,) * (len(bounds) - 1)
    key = (device, tuple(bounds), prefix_of)
    if key not in _positions:
        if len(_positions) > 16:
            _positions.clear()
        _positions[key] = shared_prefix.positions(bounds, prefix_of).to(device)
    return _positions[key]


def _needs_gather(freqs: Tensor, cu_seqlens: Tensor) -> bool:
    """Whether the rows of `freqs` are positions to gather per token (megatron's table), not
    already one per packed token (its exact-offset form, never used with shared prefixes)."""
    return (freqs.size(0) != int(cu_seqlens[-1])
            or shared_prefix.layout_of(cu_seqlens) is not None)  # fmt: skip


def _tables(freqs: Tensor, dtype: torch.dtype, mscale: float,
            cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """megatron's `(cos(freqs) * mscale).to(dtype)` and the same of sin, of the rows of
    `freqs` the tokens use (for packed rows: each token's position in its sequence). Inside a
    compiled layer (layer_compile.py) a padded row's tables are part of its graph, where they
    fuse into the rotation; otherwise they are computed once per rotary tensor."""
    if cu_seqlens is None and torch.compiler.is_compiling():
        return _cos_sin(freqs, dtype, mscale)
    return _kept_tables(freqs, dtype, mscale, cu_seqlens)


def _cos_sin(rows: Tensor, dtype: torch.dtype, mscale: float) -> tuple[Tensor, Tensor]:
    return (torch.cos(rows) * mscale).to(dtype), (torch.sin(rows) * mscale).to(dtype)


@torch.compiler.disable
def _kept_tables(freqs: Tensor, dtype: torch.dtype, mscale: float,
                 cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`_tables`, kept while `freqs` lives unchanged: every layer of a forward gets the same
    rotary tensor. Compiled layers call it as it is: traced, the cache's bookkeeping became
    guards that failed as it filled, and the layers were compiled again until dynamo gave up
    (then ran them eagerly)."""
    bounds = None if cu_seqlens is None else tuple(int(b) for b in cu_seqlens.tolist())
    key = (id(freqs), dtype, mscale, bounds, shared_prefix.layout_of(cu_seqlens))
    kept = _tables_cache.get(key)
    if kept is not None and kept[0]() is freqs and kept[1] == freqs._version:
        return kept[2], kept[3]
    rows = freqs
    if cu_seqlens is not None and _needs_gather(freqs, cu_seqlens):
        rows = freqs.index_select(0, thd_positions(cu_seqlens, freqs.device))
    cos, sin = _cos_sin(rows, dtype, mscale)
    if len(_tables_cache) >= _TABLES_KEPT:
        _tables_cache.clear()
    _tables_cache[key] = (weakref.ref(freqs), freqs._version, cos, sin)
    return cos, sin


def _rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """megatron's non-interleaved rotation of `t` [..., rot_dim]: t * cos + rotate_half * sin."""
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return (t * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


_compiled: Any = None


def _rotate_fused(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`_rotate`, on CUDA as one compiled kernel each way (shapes dynamic: one compile serves
    every sequence length); inside a compiled layer it is part of the layer's graph (tracing
    the lazy compile made a guard on it that cost each layer a recompile)."""
    global _compiled
    if not t.is_cuda or torch.compiler.is_compiling():
        return _rotate(t, cos, sin)
    if _compiled is None:
        _compiled = torch.compile(_rotate, dynamic=True, fullgraph=True)
    return _compiled(t, cos, sin)  # type: ignore[no-any-return]


def _apply(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rot_dim = cos.size(-1)
    if rot_dim == t.size(-1):
        return _rotate_fused(t, cos, sin)
    return torch.cat((_rotate_fused(t[..., :rot_dim], cos, sin), t[..., rot_dim:]), dim=-1)


def rope_thd(
    t: Tensor, cu_seqlens: Tensor, freqs: Tensor, rotary_interleaved: bool = False,
    multi_latent_attention: bool = False, mscale: float = 1.0,
) -> Tensor:
    """RoPE of packed [T, heads, dim] `t` with the table `freqs` [max_s, 1, 1, rot_dim] (or
    one entry per packed token, megatron's exact-offset form), positions restarting at 0 in
    each sequence."""
    if rotary_interleaved or multi_latent_attention:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        if _needs_gather(freqs, cu_seqlens):
            freqs = freqs.index_select(0, thd_positions(cu_seqlens, freqs.device))
        return _apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs, rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale,
        ).squeeze(1)  # fmt: skip
    cos, sin = _tables(freqs, t.dtype, mscale, cu_seqlens)
    return _apply(t.unsqueeze(1), cos, sin).squeeze(1)


def rope_bshd(t: Tensor, freqs: Tensor, mscale: float = 1.0) -> Tensor:
    """RoPE of right-padded [s, b, heads, dim] `t` with the table `freqs` [s, 1, 1, rot_dim]
    (non-interleaved, megatron's `_apply_rotary_pos_emb_bshd`)."""
    cos, sin = _tables(freqs, t.dtype, mscale)
    return _apply(t, cos, sin)


def _routed(original: Any) -> Any:
    def apply_rotary_pos_emb(
        t: Tensor, freqs: Tensor, config: Any, cu_seqlens: Tensor | None = None,
        mscale: float = 1.0, cp_group: Any = None,
    ) -> Tensor:
        if shared_prefix.layout_of(cu_seqlens) is not None and (
                config.apply_rope_fusion or (cp_group is not None and cp_group.size() != 1)):
            raise ConfigError("shared-prefix rows need the unfused RoPE and context_parallel"
                              " = 1; turn trainer.shared_prefix off")
        if config.apply_rope_fusion:
            return original(t, freqs, config, cu_seqlens, mscale, cp_group)  # type: ignore[no-any-return]
        if cu_seqlens is None:
            if config.rotary_interleaved or config.multi_latent_attention:
                return original(t, freqs, config, cu_seqlens, mscale, cp_group)  # type: ignore[no-any-return]
            return rope_bshd(t, freqs, mscale)
        if cp_group is None or cp_group.size() != 1:
            return original(t, freqs, config, cu_seqlens, mscale, cp_group)  # type: ignore[no-any-return]
        return rope_thd(t, cu_seqlens, freqs, config.rotary_interleaved,
                        config.multi_latent_attention, mscale)  # fmt: skip

    apply_rotary_pos_emb.routed_from = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def install() -> None:
    """Point megatron's attention at this module's RoPE (idempotent)."""
    from megatron.core.transformer import attention

    if not hasattr(attention.apply_rotary_pos_emb, "routed_from"):
        attention.apply_rotary_pos_emb = _routed(attention.apply_rotary_pos_emb)
