"""Sparse MLA attention: each query attends only to the DSA indexer's top-k keys, and only
those sq x k scores are computed (nothing [sq, S] is ever materialized).

The MLA "absorbed" form (DeepSeek V3.2, FlashMLA's sparse prefill): W_UK is folded into the
query (`q_lat_h = W_UK_h^T q_nope_h`, kv_lora wide, then the rope part) and W_UV applied after
the attention, so every head attends over ONE latent per token: keys `[latent, k_rope]`
([S, kv_lora + rope]), values `latent` (the keys' first kv_lora columns). The gather of a
query's k keys is done once for all heads.

Index convention: `indices` [b, sq, k] are key positions in the whole row (as under context
parallelism, where a rank's queries see every rank's keys); -1 (any negative) is "no key",
and a position after the query's own (`> q_positions`) is masked, so padding and future picks
cost nothing. A valid position must appear at most once per query (the indexer's top-k never
repeats one); a query with no valid key gets a zero output.

`sparse_mla` is the autograd function: on CUDA with Triton it runs sparse_mla_triton.py's
kernels, elsewhere this module's torch form of the same algorithm (in chunks of queries: a
chunk's k keys are gathered, scored and softmaxed; the backward recomputes the scores from the
saved log-sum-exp and scatters the key gradients with `index_add_`). The torch form
is the kernels' reference. Used by mla_attention.py's core attention for DSA layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from services.common.errors import ConfigError

_GATHER_BUDGET = 1 << 25  # float32 elements of gathered keys a chunk of queries may hold


def _chunk_size(batch: int, heads: int, topk: int, dim: int) -> int:
    return max(1, _GATHER_BUDGET // (batch * topk * max(dim, heads)))


def _gather(kv: Tensor, indices: Tensor, q_positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Keys [b, c, k, d] (float32) of a chunk's indices [b, c, k], which are valid, and the
    clamped flat positions (into kv viewed as [b * S, d]) they were read from."""
    valid = (indices >= 0) & (indices <= q_positions[None, :, None])
    safe = indices.clamp(min=0).long()
    flat = safe + torch.arange(kv.size(0), device=kv.device)[:, None, None] * kv.size(1)
    keys = kv.reshape(-1, kv.size(-1)).index_select(0, flat.reshape(-1))
    return keys.view(*indices.shape, -1).float(), valid, flat


def _probs(q: Tensor, keys: Tensor, valid: Tensor, scale: float,
           lse: Tensor | None) -> tuple[Tensor, Tensor]:
    scores = torch.einsum("bchd,bckd->bchk", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)  # [b, c, h]
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite[..., None]), lse


def torch_forward(q: Tensor, kv: Tensor, indices: Tensor, q_positions: Tensor, scale: float,
                  v_dim: int) -> tuple[Tensor, Tensor]:
    """Output [b, sq, h, v_dim] (q's dtype) and log-sum-exp [b, sq, h] (float32)."""
    b, sq, h, d = q.shape
    out = q.new_empty((b, sq, h, v_dim))
    lse = torch.empty((b, sq, h), dtype=torch.float32, device=q.device)
    step = _chunk_size(b, h, indices.size(-1), d)
    for start in range(0, sq, step):
        end = min(sq, start + step)
        keys, valid, _ = _gather(kv, indices[:, start:end], q_positions[start:end])
        probs, lse[:, start:end] = _probs(q[:, start:end], keys, valid, scale, None)
        out[:, start:end] = torch.einsum("bchk,bckv->bchv", probs, keys[..., :v_dim])
    return out, lse


def torch_backward(grad: Tensor, q: Tensor, kv: Tensor, indices: Tensor, q_positions: Tensor,
                   out: Tensor, lse: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Gradients of q and kv (float32 accumulation, returned in their dtypes)."""
    b, sq, h, d = q.shape
    v_dim = out.size(-1)
    grad_q = torch.empty_like(q)
    grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    delta = (grad.float() * out.float()).sum(-1)  # [b, sq, h]
    step = _chunk_size(b, h, indices.size(-1), d)
    for start in range(0, sq, step):
        end = min(sq, start + step)
        keys, valid, flat = _gather(kv, indices[:, start:end], q_positions[start:end])
        probs, _ = _probs(q[:, start:end], keys, valid, scale, lse[:, start:end])
        g = grad[:, start:end].float()
        dp = torch.einsum("bchv,bckv->bchk", g, keys[..., :v_dim])
        ds = probs * (dp - delta[:, start:end, :, None]) * scale
        grad_q[:, start:end] = torch.einsum("bchk,bckd->bchd", ds, keys)
        grad_keys = torch.einsum("bchk,bchd->bckd", ds, q[:, start:end].float())
        grad_keys[..., :v_dim] += torch.einsum("bchk,bchv->bckv", probs, g)
        grad_keys = grad_keys.masked_fill(~valid[..., None], 0.0)
        grad_kv.view(-1, d).index_add_(0, flat.reshape(-1), grad_keys.reshape(-1, d))
    return grad_q, grad_kv.to(kv.dtype)


def _use_triton(q: Tensor) -> bool:
    if not q.is_cuda:
        return False
    from services.trainer.attention import sparse_mla_triton

    return sparse_mla_triton.available()


class SparseMLA(torch.autograd.Function):
    """out = softmax(q . kv[indices] * scale) @ kv[indices, :v_dim], per head."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, kv: Tensor, indices: Tensor, q_positions: Tensor,
                scale: float, v_dim: int) -> Tensor:
        if _use_triton(q):
            from services.trainer.attention import sparse_mla_triton as kernels

            out, lse = kernels.forward(q, kv, indices, q_positions, scale, v_dim)
        else:
            out, lse = torch_forward(q, kv, indices, q_positions, scale, v_dim)
        ctx.save_for_backward(q, kv, indices, q_positions, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, kv, indices, q_positions, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        if _use_triton(q):
            from services.trainer.attention import sparse_mla_triton as kernels

            grad_q, grad_kv = kernels.backward(grad, q, kv, indices, q_positions, out, lse,
                                               ctx.scale)
        else:
            grad_q, grad_kv = torch_backward(grad, q, kv, indices, q_positions, out, lse,
                                             ctx.scale)
        return grad_q, grad_kv, None, None, None, None


def sparse_mla(q: Tensor, kv: Tensor, indices: Tensor, q_positions: Tensor, scale: float,
               v_dim: int) -> Tensor:
    """Sparse attention of queries q [b, sq, h, d] over latent keys kv [b, S, d] (values: their
    first `v_dim` columns) at `indices` [b, sq, k] for queries at row positions `q_positions`
    [sq] -> [b, sq, h, v_dim]."""
    if q.dim() != 4 or kv.dim() != 3 or indices.dim() != 3:
        raise ConfigError(f"sparse MLA takes q [b, sq, h, d], kv [b, S, d], indices [b, sq, k];"
                          f" got {tuple(q.shape)}, {tuple(kv.shape)}, {tuple(indices.shape)}")
    if q.shape[-1] != kv.shape[-1] or not 0 < v_dim <= kv.shape[-1]:
        raise ConfigError(f"sparse MLA: q width {q.shape[-1]}, kv width {kv.shape[-1]} and"
                          f" v_dim {v_dim} do not fit")
    if indices.shape[:2] != q.shape[:2] or q_positions.shape != (q.shape[1],):
        raise ConfigError("sparse MLA: indices and q_positions must cover q's [b, sq]")
    return SparseMLA.apply(q.contiguous(), kv.contiguous(), indices.contiguous(),  # type: ignore[no-any-return]
                           q_positions.contiguous(), scale, v_dim)


def absorbed_sparse_attention(q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor,
                              w_uk: Tensor, w_uv: Tensor, indices: Tensor, q_positions: Tensor,
                              scale: float) -> Tensor:
    """MLA attention in the absorbed form, of q_nope [b, sq, h, nope], q_rope [b, sq, h, rope],
    the normalized kv latent [b, S, r] and roped k_rope [b, S, rope] of the whole row, with
    the up projection's key part w_uk [h, nope, r] and value part w_uv [h, v, r]
    -> [b, sq, h, v]; equal to attention over K = [w_uk latent, k_rope], V = w_uv latent."""
    q_lat = torch.einsum("bshn,hnr->bshr", q_nope, w_uk)
    q = torch.cat([q_lat, q_rope], dim=-1)
    kv = torch.cat([latent, k_rope], dim=-1)
    context = sparse_mla(q, kv, indices, q_positions, scale, latent.size(-1))
    return torch.einsum("bshr,hvr->bshv", context, w_uv)
