"""Core attention on torch's fused kernels: never an S x S score tensor in memory.

`FusedAttention` takes the place of megatron's local `DotProductAttention` in the layer spec
(same constructor and forward arguments). Right-padded rows ([s, b, heads, dim], causal) run
`F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`: on a GPU its flash or
cuDNN backend, on the CPU the math/flash CPU kernels, so CI runs the same module. Packed rows
(megatron's THD format: [tokens, heads, dim] plus `cu_seqlens`) run causal SDPA per sequence
of at least `SDPA_MIN_TOKENS` (equal-length neighbours batched, as views of the packed
tensors), and torch's `varlen_attn` (a document-causal flash kernel) for the shorter ones on
CUDA in bf16/fp16; on the CPU (and in fp32), where that kernel does not run, each sequence
runs SDPA on its own, which computes the same thing. A row with shared prefixes
(shared_prefix.py) runs SDPA a sequence, a continuation's queries against its prefix's keys
and its own under a bottom-right causal mask (`shared_prefix_causal`). K/V keep their fewer heads
(grouped-query attention without repeating them in memory) wherever the kernel takes them.

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
from services.trainer.attention import shared_prefix
from services.trainer.attention.context_parallel import (
    CausalCoreAttention,
    ContextParallelAttention,
)
from services.trainer.optim.contiguous_grad import contiguous_grad


@cache
def _varlen_kwargs() -> frozenset[str] | None:
    """The keyword arguments of torch's varlen_attn, or None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


_device_copies: dict[tuple[Any, ...], Tensor] = {}  # recent batches' boundaries, by device


def _on_device(bounds: list[int], device: torch.device) -> Tensor:
    """Sequence boundaries as int32 on `device`, copied once per batch rather than once per
    layer."""
    key = (device, *bounds)
    if key not in _device_copies:
        if len(_device_copies) > 16:
            _device_copies.clear()
        _device_copies[key] = torch.tensor(bounds, dtype=torch.int32, device=device)
    return _device_copies[key]


def _sdpa(query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> Tensor:
    """SDPA whose kernel gets its output's gradient contiguous (contiguous_grad.py: cuDNN's
    backward got a compiled layer's strided one wrong)."""
    return contiguous_grad(F.scaled_dot_product_attention(query, key, value, **kwargs))


def causal_sdpa(query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """Causal attention of [b, heads, s, d] queries against [b, kv_heads, s, d] keys/values."""
    gqa = query.size(1) != key.size(1)
    return _sdpa(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)


#: Sequences of at least this many tokens run SDPA (cuDNN's Hopper kernels on an H100/H200,
#: about 1.8x the speed of varlen's flash-2 kernel fwd+bwd at 4k tokens); shorter ones share
#: one varlen call, where a launch per sequence would cost more than the kernel.
SDPA_MIN_TOKENS = 1024


def _segments(lengths: list[int], varlen: bool) -> list[tuple[int, int, int]]:
    """Consecutive sequences of a packed row grouped into kernel calls: (first sequence,
    count, length), length 0 meaning "varlen over these"; runs of equal lengths share one
    batched SDPA call."""
    out: list[tuple[int, int, int]] = []
    for i, n in enumerate(lengths):
        kind = 0 if varlen and n < SDPA_MIN_TOKENS else n
        if out and out[-1][2] == kind:
            first, count, _ = out[-1]
            out[-1] = (first, count + 1, kind)
        else:
            out.append((i, 1, kind))
    return out


def _varlen(query: Tensor, key: Tensor, value: Tensor, bounds: list[int], scale: float) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    names = _varlen_kwargs() or frozenset()
    kwargs: dict[str, Any] = {"scale": scale}
    if "is_causal" in names:
        kwargs["is_causal"] = True
    else:  # torch 2.11: causal is a window reaching back without bound and never forward
        kwargs["window_size"] = (-1, 0)
    if "enable_gqa" in names:
        kwargs["enable_gqa"] = query.size(1) != key.size(1)
    cu = _on_device([b - bounds[0] for b in bounds], query.device)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    out = varlen_attn(query, key, value, cu, cu, longest, longest, **kwargs)
    return out if isinstance(out, Tensor) else out[0]


def packed_causal(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float
) -> Tensor:
    """Document-causal attention of packed [t, heads, d] queries against [t, kv_heads, d] keys
    and values: each sequence between consecutive `cu_seqlens` attends only to itself.
    Sequences of `SDPA_MIN_TOKENS` or more run causal SDPA (equal-length neighbours batched as
    [count, heads, length, d] views of the packed tensors, no copy); shorter ones run torch's
    varlen kernel together where it runs (CUDA, fp16/bf16: flash attention), else SDPA each."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    varlen = (query.is_cuda and _varlen_kwargs() is not None
              and query.dtype in (torch.float16, torch.bfloat16))  # fmt: skip
    parts = []
    for first, count, length in _segments(lengths, varlen):
        start, end = bounds[first], bounds[first + count]
        q, k, v = query[start:end], key[start:end], value[start:end]
        if length == 0:
            parts.append(_varlen(q, k, v, bounds[first : first + count + 1], scale))
            continue
        q, k, v = (t.view(count, length, t.size(1), t.size(2)).transpose(1, 2) for t in (q, k, v))
        parts.append(causal_sdpa(q, k, v, scale).transpose(1, 2).reshape(end - start, -1,
                                                                          query.size(2)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _attend_after(query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """[n, heads, d] queries, the last n of the [m, kv_heads, d] keys and values, causal:
    query j sees keys up to m - n + j (the first m - n are a prefix everyone sees)."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    if q.size(2) == k.size(2):
        out = causal_sdpa(q, k, v, scale)
    else:
        out = _sdpa(q, k, v, attn_mask=causal_lower_right(q.size(2), k.size(2)), scale=scale,
                    enable_gqa=q.size(1) != k.size(1))  # fmt: skip
    return out[0].transpose(0, 1)


def shared_prefix_causal(
    query: Tensor, key: Tensor, value: Tensor, bounds: list[int], prefix_of: tuple[int, ...],
    scale: float,
) -> Tensor:
    """Packed attention where sequence i continues sequence `prefix_of[i]` (-1: none,
    shared_prefix.py): its queries attend to all of that prefix's keys, then causally to its
    own; every other sequence attends causally to itself (SDPA a sequence)."""
    parts = []
    for i, parent in enumerate(prefix_of):
        start, end = bounds[i], bounds[i + 1]
        k, v = key[start:end], value[start:end]
        if parent >= 0:
            k = torch.cat((key[bounds[parent] : bounds[parent + 1]], k))
            v = torch.cat((value[bounds[parent] : bounds[parent + 1]], v))
        parts.append(_attend_after(query[start:end], k, v, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@torch.compiler.disable
def thd_causal(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float
) -> Tensor:
    """A packed row's attention, with or without shared prefixes. Compiled layers
    (layer_compile.py) call it as it is: traced, its loop over the row's sequences split the
    layer into a small graph per sequence, built again for every new layout, whose calls left
    a mixed-length step waiting on the host (0.74 s compiled against 0.55 s eager, Qwen2-0.5B
    on an H200)."""
    prefix_of = shared_prefix.layout_of(cu_seqlens)
    if prefix_of is not None:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        return shared_prefix_causal(query, key, value, bounds, prefix_of, scale)
    return packed_causal(query, key, value, cu_seqlens, max_seqlen, scale)


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
            out = thd_causal(query, key, value, packed_seq_params.cu_seqlens_q,
                             int(packed_seq_params.max_seqlen_q), self.softmax_scale)  # fmt: skip
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
