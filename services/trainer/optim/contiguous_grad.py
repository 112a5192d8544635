"""`contiguous_grad`: the identity, whose backward hands on its gradient contiguous.

Two consumers of a gradient get a strided one wrong:
- megatron's mappings reduce a gradient in place over the TP group, and gloo reduces a
  strided view wrongly (the model's transposes make the fused output layer's incoming
  gradient one: fused_output.py);
- cuDNN's SDPA backward, on an H200 with torch 2.11, returned wrong q/k/v gradients (the
  forward right) when the gradient of the attention's output came in the layout a compiled
  layer's backward chose (layer_compile.py; fused_attention.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def contiguous_grad(x: Tensor) -> Tensor:
    """`x`, whose gradient reaches what produced it contiguous (`x` itself when no gradient
    flows)."""
    return _ContiguousGrad.apply(x) if x.requires_grad else x  # type: ignore[no-any-return]
