"""Core attention on torch's fused kernels: never an S x S score tensor in memory.

`FusedAttention` takes the place of megatron's local `DotProductAttention` in the layer spec
(same constructor and forward arguments). Right-padded rows ([s, b, heads, dim], causal) run
`F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`: on a GPU its flash or
cuDNN backend, on the CPU the math/flash CPU kernels, so CI runs the same module. Packed rows
(megatron's THD format: [tokens, heads, dim] plus `cu_seqlens`) run torch's
`varlen_attn` (a document-causal flash kernel) on CUDA in bf16/fp16; on the CPU (and in fp32),
where that kernel does not run, each sequence runs SDPA on its own, which computes the same
thing. K/V keep their
fewer heads (grouped-query attention without repeating them in memory) wherever the kernel
takes them.

`FusedContextParallelAttention` is context_parallel.py's attention on the same kernels: K and V
are all-gathered over the CP group and each of this rank's two query chunks attends to the
keys before its end under a bottom-right-aligned causal mask (`causal_lower_right`), which
the fused backends run without materialising it.
Selected by `trainer.model.attention_backend` (model.py `attention_spec`).
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from services.common.errors import ConfigError
from services.trainer.context_parallel import CausalCoreAttention, ContextParallelAttention


@cache
def _varlen_kwargs() -> frozenset[str] | None:
    """The keyword arguments of torch's varlen_attn, or None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


_device_copy: list[Tensor] = []  # [host boundaries, their device copy] of the last batch


def _on_device(cu_seqlens: Tensor, device: torch.device) -> Tensor:
    """`cu_seqlens` as int32 on `device`, copied once per batch rather than once per layer
    (the host tensor is held, so its identity cannot be reused while cached)."""
    if cu_seqlens.device == device:
        return cu_seqlens.to(torch.int32)
    if not _device_copy or _device_copy[0] is not cu_seqlens or _device_copy[1].device != device:
        _device_copy[:] = [cu_seqlens, cu_seqlens.to(device=device, dtype=torch.int32)]
    return _device_copy[1]


def causal_sdpa(query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """Causal attention of [b, heads, s, d] queries against [b, kv_heads, s, d] keys/values."""
    gqa = query.size(1) != key.size(1)
    return F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scale, enable_gqa=gqa
    )


def packed_causal(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float
) -> Tensor:
    """Document-causal attention of packed [t, heads, d] queries against [t, kv_heads, d] keys
    and values: each sequence between consecutive `cu_seqlens` attends only to itself."""
    names = _varlen_kwargs()
    # torch's varlen kernel is flash attention: CUDA, and fp16/bf16 only
    if query.is_cuda and names is not None and query.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        kwargs: dict[str, Any] = {"scale": scale}
        if "is_causal" in names:
            kwargs["is_causal"] = True
        else:  # torch 2.11: causal is a window reaching back without bound and never forward
            kwargs["window_size"] = (-1, 0)
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = query.size(1) != key.size(1)
        cu = _on_device(cu_seqlens, query.device)
        out = varlen_attn(query, key, value, cu, cu, max_seqlen, max_seqlen, **kwargs)
        return out if isinstance(out, Tensor) else out[0]
    bounds = cu_seqlens.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        parts.append(causal_sdpa(q, k, v, scale)[0].transpose(0, 1))
    return torch.cat(parts)


class FusedAttention(CausalCoreAttention):
    """Causal core attention on fused kernels, for right-padded or packed (THD) rows.

    Takes the arguments megatron's DotProductAttention takes; query [sq, b, np, hn] and key,
    value [sk, b, ng, hn] (THD: [t, np, hn] and [t, ng, hn]); returns [sq, b, np * hn]
    (THD: [t, np * hn])."""

    name = "fused attention"

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ConfigError("fused attention is causal by construction: no mask or bias")
        if self.dropout.p > 0:
            raise ConfigError("fused attention runs without attention dropout (set it to 0)")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ConfigError(f"packed rows must be THD, not {packed_seq_params.qkv_format}")
            out = packed_causal(query, key, value, packed_seq_params.cu_seqlens_q,
                                int(packed_seq_params.max_seqlen_q), self.softmax_scale)
            return out.reshape(out.size(0), -1)
        sq, batch, heads, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, h]
        context = causal_sdpa(q, k, v, self.softmax_scale)
        return context.permute(2, 0, 1, 3).reshape(sq, batch, -1)


class FusedContextParallelAttention(ContextParallelAttention):
    """Context-parallel causal attention (context_parallel.py's layout and K/V exchange) on
    SDPA: this rank's chunks r and 2*CP-1-r of the queries against the keys before their end,
    under a bottom-right-aligned causal mask."""

    def attend(self, query: Tensor, key: Tensor, value: Tensor, rank: int, size: int) -> Tensor:
        from torch.nn.attention.bias import causal_lower_right

        if self.dropout.p > 0:
            raise ConfigError("fused attention runs without attention dropout (set it to 0)")
        sq, batch, heads, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, h]
        chunk = sq // 2
        parts = []
        for i, index in enumerate((rank, 2 * size - 1 - rank)):
            end = (index + 1) * chunk
            parts.append(F.scaled_dot_product_attention(
                q[:, :, i * chunk : (i + 1) * chunk], k[:, :, :end], v[:, :, :end],
                attn_mask=causal_lower_right(chunk, end), scale=self.softmax_scale,
                enable_gqa=heads != k.size(1),
            ))  # fmt: skip
        context = torch.cat(parts, dim=2)
        return context.permute(2, 0, 1, 3).reshape(sq, batch, -1)
