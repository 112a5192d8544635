"""Triton kernels for chunked_logprobs.py on CUDA: one pass over the logits each way.

`row_lse_and_target` reads each token's row of (this TP rank's) logits once, in the logits'
dtype, and returns the fp32 log-sum-exp of logits / T (an online max and sum, as flash
attention does) and the target's logit / T (0 where the target lies in another rank's
shard). `row_grad` reads each row once more and writes d log p(target) / d logits in the
logits' dtype: (onehot(target) - softmax(logits / T)) * grad / T. No fp32 copy of the
[tokens, vocab] logits is made. chunked_logprobs.py uses these where `available()` (a CUDA
tensor and triton importable) and its torch chunks elsewhere (the CPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: chunked_logprobs.py's torch path runs
    triton = None

BLOCK = 4096


def available(logits: Tensor) -> bool:
    """Whether the kernels can score `logits` (on CUDA, rows contiguous, triton present)."""
    return triton is not None and logits.is_cuda and logits.stride(-1) == 1


if triton is not None:

    @triton.jit
    def _lse_kernel(logits, targets, lse_out, picked_out, row_stride, width, inv_t,
                    BLOCK: tl.constexpr) -> None:  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        running_max = tl.full((BLOCK,), float("-inf"), tl.float32)
        running_sum = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
            x = x * inv_t
            new_max = tl.maximum(running_max, x)
            # lanes still at -inf (masked so far) add nothing; avoid inf - inf
            scale = tl.where(new_max == float("-inf"), 0.0, tl.exp(running_max - new_max))
            add = tl.where(new_max == float("-inf"), 0.0, tl.exp(x - new_max))
            running_sum = running_sum * scale + add
            running_max = new_max
        top = tl.max(running_max, axis=0)
        total = tl.sum(running_sum * tl.exp(running_max - top), axis=0)
        tl.store(lse_out + row, top + tl.log(total))
        target = tl.load(targets + row)
        hit = (target >= 0) & (target < width)
        value = tl.load(base + tl.where(hit, target, 0)).to(tl.float32) * inv_t
        tl.store(picked_out + row, tl.where(hit, value, 0.0))

    @triton.jit
    def _grad_kernel(logits, targets, lse, grad, out, row_stride, out_stride, width, inv_t,
                     BLOCK: tl.constexpr) -> None:  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        g = tl.load(grad + row) * inv_t
        row_lse = tl.load(lse + row)
        target = tl.load(targets + row)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < width
            x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) * inv_t
            value = -g * tl.exp(x - row_lse) + tl.where(cols == target, g, 0.0)
            tl.store(out + row * out_stride + cols, value.to(out.dtype.element_ty), mask=inside)


def row_lse_and_target(
    flat: Tensor, local_targets: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """(log-sum-exp [N], target logit [N]) of logits / T over rows `flat` [N, W]; targets
    outside [0, W) give 0."""
    rows, width = flat.shape
    lse = torch.empty(rows, dtype=torch.float32, device=flat.device)
    picked = torch.empty_like(lse)
    if rows:
        _lse_kernel[(rows,)](flat, local_targets.contiguous(), lse, picked, flat.stride(0),
                             width, 1.0 / temperature, BLOCK=BLOCK, num_warps=8)  # fmt: skip
    return lse, picked


def row_grad(
    flat: Tensor, local_targets: Tensor, lse: Tensor, grad: Tensor, temperature: float
) -> Tensor:
    """d(target logit / T - lse) / d flat, times `grad` [N], in flat's dtype [N, W]; targets
    outside [0, W) add no one-hot term."""
    rows, width = flat.shape
    out = torch.empty((rows, width), dtype=flat.dtype, device=flat.device)
    if rows:
        _grad_kernel[(rows,)](flat, local_targets.contiguous(), lse.contiguous(),
                              grad.float().contiguous(), out, flat.stride(0), out.stride(0),
                              width, 1.0 / temperature, BLOCK=BLOCK, num_warps=8)  # fmt: skip
    return out


def kernels() -> Any:
    """This module's triton (None without it), for tests that need to know."""
    return triton
