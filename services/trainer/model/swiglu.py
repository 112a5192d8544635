"""The MLP's SwiGLU with a one-pass backward: silu(a) * b of the fc1 output [.., 2F] = [a | b].

megatron's fused SwiGLU (bias_swiglu_impl) differentiates as `cat(d_a, d_b)`. Compiled, that
became one elementwise kernel over the [tokens, 2F] gradient in which every element loads the
a, b and incoming-gradient values of its pair, so each input was read twice: on an H200 it ran
at 2.3 TB/s and took 72 ms of a 1.32 s step of a Qwen2-1.5B shape (packed, 65k tokens),
against 23 ms for the forward. `swiglu_backward` is one pass over the pairs instead: a triton
kernel on CUDA that reads a, b and the gradient once and writes both halves (aten's
silu_backward elsewhere, e.g. the CPU). The forward stays plain torch, which inductor fuses
with what surrounds it.

`with_swiglu(spec)` puts `SwiGLU` into a dense layer spec's MLP, and `use_swiglu(config)`
sets megatron's switch for an activation module taken from the spec (named after
TransformerEngine's, which it was made for; the module gets the whole fc1 output). MoE
experts and TransformerEngine's own layers keep megatron's activation.
Called by model.build_gpt_model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: aten's silu_backward runs
    triton = None

BLOCK = 1024


if triton is not None:

    @triton.jit
    def _backward_kernel(grad, pre, out, width, grad_stride, pre_stride,
                         BLOCK: tl.constexpr) -> None:  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        g = tl.load(grad + row * grad_stride + cols, mask=inside, other=0.0).to(tl.float32)
        a = tl.load(pre + row * pre_stride + cols, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(pre + row * pre_stride + width + cols, mask=inside, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        d_a = g * b * sig * (1.0 + a * (1.0 - sig))
        d_b = g * a * sig
        tl.store(out + row * pre_stride + cols, d_a.to(out.dtype.element_ty), mask=inside)
        tl.store(out + row * pre_stride + width + cols, d_b.to(out.dtype.element_ty),
                 mask=inside)  # fmt: skip


@torch.library.custom_op("riptide::swiglu_backward", mutates_args=())
def swiglu_backward(grad: Tensor, pre: Tensor) -> Tensor:
    """d/d pre of sum(grad * silu(a) * b), pre = [a | b] on the last dim."""
    width = grad.size(-1)
    if triton is not None and grad.is_cuda:
        g = grad.reshape(-1, width).contiguous()
        p = pre.reshape(-1, 2 * width).contiguous()
        out = torch.empty_like(p)
        if g.size(0):
            grid = (g.size(0), triton.cdiv(width, BLOCK))
            _backward_kernel[grid](g, p, out, width, g.stride(0), p.stride(0), BLOCK=BLOCK)
        return out.view(pre.shape)
    a, b = pre.chunk(2, dim=-1)
    return torch.cat((torch.ops.aten.silu_backward(grad * b, a), grad * F.silu(a)), dim=-1)


@swiglu_backward.register_fake
def _(grad: Tensor, pre: Tensor) -> Tensor:
    return torch.empty_like(pre, memory_format=torch.contiguous_format)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, pre: Tensor) -> Tensor:
        ctx.save_for_backward(pre)
        a, b = pre.chunk(2, dim=-1)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (pre,) = ctx.saved_tensors
        return swiglu_backward(grad, pre)  # type: ignore[no-any-return]


def swiglu(pre: Tensor) -> Tensor:
    """silu(a) * b of `pre` = [a | b] on its last dim."""
    return _SwiGLU.apply(pre)  # type: ignore[no-any-return]


class SwiGLU(torch.nn.Module):
    """The activation module of a gated MLP (megatron builds it with the layer's config)."""

    def __init__(self, config: Any = None) -> None:
        super().__init__()

    def forward(self, pre: Tensor) -> Tensor:
        return swiglu(pre)


def with_swiglu(spec: Any) -> Any:
    """A copy of the local layer `spec` whose dense MLP takes its activation from `SwiGLU`;
    `spec` itself where its MLP has no such slot (MoE experts, TransformerEngine's layers)."""
    mlp = getattr(getattr(spec, "submodules", None), "mlp", None)
    slots = getattr(mlp, "submodules", None)
    if slots is None or not hasattr(slots, "activation_func") or not hasattr(slots, "linear_fc1"):
        return spec
    spec = copy.deepcopy(spec)
    spec.submodules.mlp.submodules.activation_func = SwiGLU
    return spec


def uses_swiglu(spec: Any) -> bool:
    mlp = getattr(getattr(spec, "submodules", None), "mlp", None)
    return getattr(getattr(mlp, "submodules", None), "activation_func", None) is SwiGLU


def use_swiglu(config: Any) -> None:
    """Have megatron's MLP call its spec's activation module on the whole fc1 output."""
    config.bias_activation_fusion = False
    config.use_te_activation_func = True
