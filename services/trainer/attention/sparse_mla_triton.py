"""Triton kernels of sparse MLA attention (sparse_mla.py holds the contract and the torch form
they are tested against).

One program per (query, block of heads): the query's k indices are read in blocks of
BLOCK_N, each block's latent keys gathered ONCE for all the block's heads, and the scores are
two tensor-core matmuls, [heads x v] @ [v x BLOCK_N] on the latent part plus
[heads x rope] @ [rope x BLOCK_N]. Forward: online softmax in base 2, the output and its
log-sum-exp saved. Backward (after `delta = rowsum(dO * O)`): the same loop recomputes the
probabilities from the log-sum-exp and accumulates dQ in registers; the key gradients go into
a float32 dKV by atomic adds (the keys a query picks are scattered over the row; DeepSeek
V3.2's own sparse-MLA backward adds them the same way). `BACKWARD = "split"` adds them from a
second kernel whose program holds one query with ALL its heads (the scores over column
chunks, so nothing [heads x v] stays in registers): each key's gradient is added once per
query rather than once per head block; "fused" adds them from the dQ loop. With
`VECTOR_ATOMICS` the split kernel adds pairs of neighbouring float32 values with one vector
atomic (`red...add.v2.f32`, Hopper and later; Triton's own atomic_add issues one instruction
per value), as DeepSeek's kernel adds quads, since the atomics seem to bound that kernel.
Its CUDA test passes on an H100 (the same errors as the plain adds), but its speed has not
been measured yet (bench/trainer_mla_gpu.py's `split-pairs` variant), so it stays off.
Importing this module needs `triton`; `available()` says whether it is there.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: sparse_mla.py's torch form runs instead
    triton = None


@functools.cache
def available() -> bool:
    """Whether Triton is importable (the kernels then run on CUDA tensors)."""
    return triton is not None


_LOG2E = 1.4426950408889634

if triton is not None:

    def _configs(block_h: list[int], block_n: list[int]) -> list[Any]:
        return [triton.Config({"BLOCK_H": h, "BLOCK_N": n}, num_warps=w, num_stages=1)
                for h in block_h for n in block_n for w in (4, 8)]

    def _prune(configs: list[Any], named_args: dict[str, Any], **_: Any) -> list[Any]:
        heads = named_args["H"]
        if os.environ.get("TRITON_INTERPRET") == "1":  # one config: the interpreter is slow
            return [c for c in configs if c.kwargs["BLOCK_H"] == 16][:1]
        fit = [c for c in configs if c.kwargs["BLOCK_H"] <= max(16, heads)]
        return fit or configs[:1]

    @triton.autotune(configs=_configs([16, 32, 64], [32, 64]), key=["H", "TOPK", "D_V", "D_R"],
                     prune_configs_by={"early_config_prune": _prune})
    @triton.jit
    def _forward_kernel(Q, KV, IDX, QPOS, OUT, LSE, scale_log2,  # type: ignore[no-untyped-def]
                        S, H, TOPK,
                        D_V: tl.constexpr, D_R: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        s_id, b_id, h_blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        sq = tl.num_programs(0)
        d = D_V + D_R
        heads = h_blk * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < H
        cols_v, cols_r = tl.arange(0, D_V), tl.arange(0, D_R)
        row = (b_id * sq + s_id).to(tl.int64)
        q_ptr = Q + (row * H + heads[:, None]) * d
        q_v = tl.load(q_ptr + cols_v[None, :], mask=head_ok[:, None], other=0.0)
        q_r = tl.load(q_ptr + D_V + cols_r[None, :], mask=head_ok[:, None], other=0.0)
        q_pos = tl.load(QPOS + s_id)
        kv_ptr = KV + b_id.to(tl.int64) * S * d
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D_V], tl.float32)
        for start in range(0, TOPK, BLOCK_N):
            slots = start + tl.arange(0, BLOCK_N)
            idx = tl.load(IDX + row * TOPK + slots, mask=slots < TOPK, other=-1)
            valid = (idx >= 0) & (idx <= q_pos)
            key_ptr = kv_ptr + tl.where(valid, idx, 0).to(tl.int64)[:, None] * d
            k_v = tl.load(key_ptr + cols_v[None, :], mask=valid[:, None], other=0.0)
            k_r = tl.load(key_ptr + D_V + cols_r[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q_v, tl.trans(k_v)) + tl.dot(q_r, tl.trans(k_r))
            scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(k_v.dtype), k_v)
            m = m_new
        empty = l_sum == 0.0
        out = acc / tl.where(empty, 1.0, l_sum)[:, None]
        lse = (m + tl.log2(tl.where(empty, 1.0, l_sum))) / 1.4426950408889634
        lse = tl.where(empty, float("-inf"), lse)
        o_ptr = OUT + (row * H + heads[:, None]) * D_V + cols_v[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=head_ok[:, None])
        tl.store(LSE + row * H + heads, lse, mask=head_ok)

    # Small tiles: larger ones ran out of shared memory on an H200 at v = 512; few of them:
    # at 65k tokens each one's benchmark takes seconds (12 did not finish in 170 s).
    @triton.autotune(configs=_configs([16, 32], [16]),
                     key=["H", "TOPK", "D_V", "D_R", "WITH_DKV"],
                     prune_configs_by={"early_config_prune": _prune}, reset_to_zero=["DKV"])
    @triton.jit
    def _backward_kernel(Q, KV, IDX, QPOS, DO, LSE, DELTA, DQ, DKV,  # type: ignore[no-untyped-def]
                         scale, S, H, TOPK,
                         D_V: tl.constexpr, D_R: tl.constexpr, WITH_DKV: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        s_id, b_id, h_blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        sq = tl.num_programs(0)
        d = D_V + D_R
        heads = h_blk * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < H
        cols_v, cols_r = tl.arange(0, D_V), tl.arange(0, D_R)
        row = (b_id * sq + s_id).to(tl.int64)
        q_ptr = Q + (row * H + heads[:, None]) * d
        q_v = tl.load(q_ptr + cols_v[None, :], mask=head_ok[:, None], other=0.0)
        q_r = tl.load(q_ptr + D_V + cols_r[None, :], mask=head_ok[:, None], other=0.0)
        d_o = tl.load(DO + (row * H + heads[:, None]) * D_V + cols_v[None, :],
                      mask=head_ok[:, None], other=0.0)
        lse = tl.load(LSE + row * H + heads, mask=head_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(DELTA + row * H + heads, mask=head_ok, other=0.0)
        q_pos = tl.load(QPOS + s_id)
        kv_ptr = KV + b_id.to(tl.int64) * S * d
        dkv_ptr = DKV + b_id.to(tl.int64) * S * d
        dq_v = tl.zeros([BLOCK_H, D_V], tl.float32)
        dq_r = tl.zeros([BLOCK_H, D_R], tl.float32)
        for start in range(0, TOPK, BLOCK_N):
            slots = start + tl.arange(0, BLOCK_N)
            idx = tl.load(IDX + row * TOPK + slots, mask=slots < TOPK, other=-1)
            valid = (idx >= 0) & (idx <= q_pos)
            offset = tl.where(valid, idx, 0).to(tl.int64)[:, None] * d
            k_v = tl.load(kv_ptr + offset + cols_v[None, :], mask=valid[:, None], other=0.0)
            k_r = tl.load(kv_ptr + offset + D_V + cols_r[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q_v, tl.trans(k_v)) + tl.dot(q_r, tl.trans(k_r))
            p = tl.exp2(scores * (scale * 1.4426950408889634) - lse2[:, None])
            p = tl.where(valid[None, :], p, 0.0)
            dp = tl.dot(d_o, tl.trans(k_v))
            ds = (p * (dp - delta[:, None]) * scale).to(q_v.dtype)
            dq_v += tl.dot(ds, k_v)
            dq_r += tl.dot(ds, k_r)
            if WITH_DKV:
                ds_t = tl.trans(ds)
                dk_v = tl.dot(ds_t, q_v) + tl.dot(tl.trans(p.to(d_o.dtype)), d_o)
                dk_r = tl.dot(ds_t, q_r)
                tl.atomic_add(dkv_ptr + offset + cols_v[None, :], dk_v, mask=valid[:, None],
                              sem="relaxed")
                tl.atomic_add(dkv_ptr + offset + D_V + cols_r[None, :], dk_r,
                              mask=valid[:, None], sem="relaxed")
        dq_ptr = DQ + (row * H + heads[:, None]) * d
        tl.store(dq_ptr + cols_v[None, :], dq_v.to(DQ.dtype.element_ty), mask=head_ok[:, None])
        tl.store(dq_ptr + D_V + cols_r[None, :], dq_r.to(DQ.dtype.element_ty),
                 mask=head_ok[:, None])


    @triton.jit
    def _add_pairs(ptr, value):  # type: ignore[no-untyped-def]
        """dst[ptr] += value, two neighbouring values a vector atomic where their addresses
        are consecutive and 8-byte aligned (the tensor-core accumulator's layout holds column
        pairs in one thread), else one atomic each."""
        return tl.inline_asm_elementwise(
            """{
            .reg .pred pair;
            .reg .b64 next, low;
            add.s64 next, $2, 4;
            and.b64 low, $2, 7;
            setp.eq.s64 pair, low, 0;
            setp.eq.and.s64 pair, next, $3, pair;
            @pair red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5};
            @!pair red.relaxed.gpu.global.add.f32 [$2], $4;
            @!pair red.relaxed.gpu.global.add.f32 [$3], $5;
            mov.b32 $0, 0;
            mov.b32 $1, 0;
            }""",
            # the address and the value's bits as integers: older Triton refuses to broadcast
            # a pointer with a float among an inline asm's arguments
            "=r,=r,l,l,r,r", [ptr.to(tl.int64), value.to(tl.int32, bitcast=True)],
            dtype=tl.int32, is_pure=False, pack=2)

    @triton.jit
    def _add(ptr, value, mask, PAIRS: tl.constexpr):  # type: ignore[no-untyped-def]
        """Float32 atomic adds of `value` at `ptr` where `mask`; with PAIRS, as vector pairs
        (masked lanes then add 0.0 at `ptr`, which must stay a valid address)."""
        if PAIRS:
            _add_pairs(ptr, tl.where(mask, value, 0.0))
        else:
            tl.atomic_add(ptr, value, mask=mask, sem="relaxed")

    def _dkv_configs() -> list[Any]:
        return [triton.Config({"BLOCK_N": n, "BLOCK_D": c}, num_warps=w, num_stages=1)
                for n in (16, 32) for c in (16, 64) for w in (4, 8)]  # fmt: skip

    def _prune_dkv(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
        v_dim = {**named_args, **kwargs}["D_V"]
        fit = [c for c in configs if c.kwargs["BLOCK_D"] <= v_dim]
        if os.environ.get("TRITON_INTERPRET") == "1":
            return [c for c in fit if c.kwargs["BLOCK_N"] == 16][:1]
        return [c for c in fit if c.kwargs["BLOCK_D"] > 16] or fit

    @triton.autotune(configs=_dkv_configs(), key=["H", "TOPK", "D_V", "D_R"],
                     prune_configs_by={"early_config_prune": _prune_dkv},
                     reset_to_zero=["DKV"])
    @triton.jit
    def _dkv_kernel(Q, KV, IDX, QPOS, DO, LSE, DELTA, DKV,  # type: ignore[no-untyped-def]
                    scale, S, H, TOPK,
                    D_V: tl.constexpr, D_R: tl.constexpr, HEADS: tl.constexpr,
                    PAIRS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """One query, all its heads: the scores of a key block are [HEADS x BLOCK_N], built
        over chunks of BLOCK_D columns, and each key's gradient is added once per query."""
        s_id, b_id = tl.program_id(0), tl.program_id(1)
        sq = tl.num_programs(0)
        d = D_V + D_R
        heads = tl.arange(0, HEADS)
        head_ok = heads < H
        cols_d, cols_r = tl.arange(0, BLOCK_D), tl.arange(0, D_R)
        row = (b_id * sq + s_id).to(tl.int64)
        q_ptr = Q + (row * H + heads[:, None]) * d
        do_ptr = DO + (row * H + heads[:, None]) * D_V
        q_r = tl.load(q_ptr + D_V + cols_r[None, :], mask=head_ok[:, None], other=0.0)
        lse = tl.load(LSE + row * H + heads, mask=head_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(DELTA + row * H + heads, mask=head_ok, other=0.0)
        q_pos = tl.load(QPOS + s_id)
        kv_ptr = KV + b_id.to(tl.int64) * S * d
        dkv_ptr = DKV + b_id.to(tl.int64) * S * d
        for start in range(0, TOPK, BLOCK_N):
            slots = start + tl.arange(0, BLOCK_N)
            idx = tl.load(IDX + row * TOPK + slots, mask=slots < TOPK, other=-1)
            valid = (idx >= 0) & (idx <= q_pos)
            offset = tl.where(valid, idx, 0).to(tl.int64)[:, None] * d
            k_r = tl.load(kv_ptr + offset + D_V + cols_r[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q_r, tl.trans(k_r))
            dp = tl.zeros([HEADS, BLOCK_N], tl.float32)
            for c in tl.static_range(0, D_V, BLOCK_D):
                k_c = tl.load(kv_ptr + offset + c + cols_d[None, :], mask=valid[:, None],
                              other=0.0)
                q_c = tl.load(q_ptr + c + cols_d[None, :], mask=head_ok[:, None], other=0.0)
                do_c = tl.load(do_ptr + c + cols_d[None, :], mask=head_ok[:, None], other=0.0)
                scores += tl.dot(q_c, tl.trans(k_c))
                dp += tl.dot(do_c, tl.trans(k_c))
            p = tl.exp2(scores * (scale * 1.4426950408889634) - lse2[:, None])
            p = tl.where(valid[None, :], p, 0.0)
            ds_t = tl.trans((p * (dp - delta[:, None]) * scale).to(q_r.dtype))
            p_t = tl.trans(p.to(q_r.dtype))
            for c in tl.static_range(0, D_V, BLOCK_D):
                q_c = tl.load(q_ptr + c + cols_d[None, :], mask=head_ok[:, None], other=0.0)
                do_c = tl.load(do_ptr + c + cols_d[None, :], mask=head_ok[:, None], other=0.0)
                dk_c = tl.dot(ds_t, q_c) + tl.dot(p_t, do_c)
                _add(dkv_ptr + offset + c + cols_d[None, :], dk_c, valid[:, None], PAIRS)
            _add(dkv_ptr + offset + D_V + cols_r[None, :], tl.dot(ds_t, q_r), valid[:, None],
                 PAIRS)


BACKWARD = "split"  # "split": dQ and dKV kernels; "fused": one kernel, dKV per head block
#: Whether the split backward adds dKV in vector pairs where the GPU has them (checked on a
#: GPU, off until measured faster; the bench's `split-pairs` variant turns it on).
VECTOR_ATOMICS = False


def vector_pairs(q: Tensor) -> bool:
    """Vector float32 atomics: compiled (not the interpreter), on a GPU of compute capability
    9.0 or later (`red.add.v2.f32` is Hopper's)."""
    return (VECTOR_ATOMICS and os.environ.get("TRITON_INTERPRET") != "1" and q.is_cuda
            and torch.cuda.get_device_capability(q.device)[0] >= 9)


def _check(q: Tensor, v_dim: int) -> int:
    rope = q.size(-1) - v_dim
    for width in (v_dim, rope):
        if width < 16 or width & (width - 1):
            raise ValueError(f"the Triton sparse MLA kernel needs power-of-two widths >= 16,"
                             f" got v {v_dim}, rope {rope}")
    return rope


def _grid(sq: int, b: int, heads: int) -> Any:
    return lambda meta: (sq, b, triton.cdiv(heads, meta["BLOCK_H"]))


def forward(q: Tensor, kv: Tensor, indices: Tensor, q_positions: Tensor, scale: float,
            v_dim: int) -> tuple[Tensor, Tensor]:
    """Output [b, sq, h, v_dim] and log-sum-exp [b, sq, h] (natural log, float32)."""
    rope = _check(q, v_dim)
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v_dim))
    lse = torch.empty((b, sq, h), dtype=torch.float32, device=q.device)
    idx = indices.to(torch.int32).contiguous()
    pos = q_positions.to(torch.int32).contiguous()
    _forward_kernel[_grid(sq, b, h)](q, kv, idx, pos, out, lse, scale * _LOG2E,
                                     kv.size(1), h, idx.size(-1), D_V=v_dim, D_R=rope)
    return out, lse


def backward(grad: Tensor, q: Tensor, kv: Tensor, indices: Tensor, q_positions: Tensor,
             out: Tensor, lse: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Gradients of q and kv (dKV accumulated in float32)."""
    b, sq, h, _ = q.shape
    v_dim = out.size(-1)
    rope = _check(q, v_dim)
    delta = (grad.float() * out.float()).sum(-1).contiguous()
    grad_q = torch.empty_like(q)
    grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    idx = indices.to(torch.int32).contiguous()
    pos = q_positions.to(torch.int32).contiguous()
    fused = BACKWARD == "fused"
    _backward_kernel[_grid(sq, b, h)](q, kv, idx, pos, grad, lse, delta, grad_q, grad_kv,
                                      scale, kv.size(1), h, idx.size(-1), D_V=v_dim, D_R=rope,
                                      WITH_DKV=fused)
    if not fused:
        _dkv_kernel[(sq, b)](q, kv, idx, pos, grad, lse, delta, grad_kv, scale, kv.size(1), h,
                             idx.size(-1), D_V=v_dim, D_R=rope,
                             HEADS=max(16, triton.next_power_of_2(h)), PAIRS=vector_pairs(q))
    return grad_q, grad_kv.to(kv.dtype)


def flops(num_pairs: int, heads: int, v_dim: int, rope: int) -> tuple[float, float]:
    """Matmul FLOPs (forward, backward) for `num_pairs` valid (query, key) pairs: forward
    QK^T and PV, backward QK^T again, dP = dO V^T, dV, dQ, dK."""
    qk, pv = 2 * heads * (v_dim + rope), 2 * heads * v_dim
    return float(num_pairs * (qk + pv)), float(num_pairs * (3 * qk + 2 * pv))

