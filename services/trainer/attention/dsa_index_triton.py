"""The DSA indexer's scores as one Triton kernel (sparse_attention.py holds the indexer and
the torch form this is tested against).

For a chunk of queries and the row's keys it writes

    index[b, i, j] = sum_h  w[b, i, h] * relu(scale * q[b, i, h] . k[b, j])    (j <= pos[i])

and -inf for a key after the query's position, in float32. The torch form computes the same in
three passes over a [queries x heads x keys] float32 tensor (scores, relu, the weighted sum
over heads); here one program holds a [BLOCK_M x BLOCK_N] tile of the result in registers and
loops over the heads, each head one tensor-core matmul of [BLOCK_M x D] by [D x BLOCK_N]. The
products of bfloat16 inputs are exact in float32, so the scores equal the torch form's
float32 matmul up to the order of the sums. A tile whose keys all come after its queries is
written as -inf without a matmul (half of a causal row's tiles).
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
except ImportError:  # CPU installs: the torch form runs instead
    triton = None


@functools.cache
def available() -> bool:
    """Whether Triton is importable (the kernel then runs on CUDA tensors)."""
    return triton is not None


if triton is not None:

    def _configs() -> list[Any]:
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                for m in (64, 128) for n in (64, 128) for w in (4, 8) for s in (2, 3)]  # fmt: skip

    def _prune(configs: list[Any], named_args: dict[str, Any], **_: Any) -> list[Any]:
        if os.environ.get("TRITON_INTERPRET") == "1":  # one config: the interpreter is slow
            return [c for c in configs if c.kwargs["BLOCK_M"] == 64
                    and c.kwargs["BLOCK_N"] == 64][:1]
        return configs

    @triton.autotune(configs=_configs(), key=["H", "D", "SQ_BUCKET", "T_BUCKET"],
                     prune_configs_by={"early_config_prune": _prune})
    @triton.jit
    def _index_kernel(Q, K, W, QPOS, OUT, scale,  # type: ignore[no-untyped-def]
                      SQ, T, H, SQ_BUCKET, T_BUCKET,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        n_blk, m_blk, b_id = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        keys = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, key_ok = rows < SQ, keys < T
        q_pos = tl.load(QPOS + rows, mask=row_ok, other=-1)
        batch = b_id.to(tl.int64)
        out_ptr = OUT + (batch * SQ + rows[:, None]) * T + keys[None, :]
        store_ok = row_ok[:, None] & key_ok[None, :]
        if n_blk * BLOCK_N > tl.max(q_pos):  # every key of the tile is in the future
            tl.store(out_ptr, tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32),
                     mask=store_ok)
        else:
            cols = tl.arange(0, D)
            k = tl.load(K + (batch * T + keys[:, None]) * D + cols[None, :],
                        mask=key_ok[:, None], other=0.0)
            k_t = tl.trans(k)
            q_ptr = Q + ((batch * SQ + rows[:, None]) * H) * D + cols[None, :]
            w_ptr = W + (batch * SQ + rows) * H
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for h in range(H):
                q = tl.load(q_ptr + h * D, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptr + h, mask=row_ok, other=0.0)
                scores = tl.maximum(tl.dot(q, k_t) * scale, 0.0)
                acc += scores * w[:, None]
            future = keys[None, :] > q_pos[:, None]
            tl.store(out_ptr, tl.where(future, float("-inf"), acc), mask=store_ok)


def supports(q: Tensor) -> bool:
    """Whether the kernel takes these query heads: CUDA, 16-bit floats (whose products are
    exact in the float32 accumulator), a power-of-two head width of at least 16."""
    d = q.size(-1)
    return (available() and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and d >= 16 and d & (d - 1) == 0)


def index_scores(q: Tensor, k: Tensor, weights: Tensor, positions: Tensor, scale: float
                 ) -> Tensor:
    """[b, sq, T] float32 index scores of queries q [b, sq, heads, d] against keys k [b, T, d]
    (same dtype), per-head weights [b, sq, heads] (float32), the queries' row positions [sq]
    (keys after them -inf)."""
    b, sq, heads, d = q.shape
    t = k.size(1)
    out = torch.empty((b, sq, t), dtype=torch.float32, device=q.device)
    q, k = q.contiguous(), k.contiguous().to(q.dtype)
    w = weights.float().contiguous()
    pos = positions.to(torch.int32).contiguous()

    def grid(meta: dict[str, int]) -> tuple[int, int, int]:
        return (triton.cdiv(t, meta["BLOCK_N"]), triton.cdiv(sq, meta["BLOCK_M"]), b)

    # The autotune key buckets the lengths (powers of two), so a new chunk length does not
    # re-tune every time.
    _index_kernel[grid](q, k, w, pos, out, scale, sq, t, heads,
                        triton.next_power_of_2(sq), triton.next_power_of_2(t), D=d)
    return out
