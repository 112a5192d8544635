"""torch.compile of the transformer layers, for the GPU path.

Between its matmuls a megatron-core layer runs dozens of small kernels (norms, residual adds,
SwiGLU, the RoPE rotation), and on a GPU its Python (the linear wrappers, the layer's own
bookkeeping) takes longer to issue a small model's forward than the GPU takes to run it.
Compiling each `TransformerLayer` with inductor fuses that elementwise work and runs the
layer's graphs without the Python in between. The packed attention's loop over sequence
boundaries is a graph break, so a layer compiles into the pieces on either side of it; every
layer of a model shares the same compiled code (parameters are graph inputs, not guards), and
a new micro-batch shape compiles once more, then shapes are treated as dynamic.

`trainer.model.compile_layers`: "auto" compiles where the model lives on a GPU (on an H200 it
took the packed step of a Qwen2-0.5B shape from 0.690 s to 0.621 s and of a 1.5B shape from
1.558 s to 1.351 s: bench/trainer_gpu.py --compile on,off); on the CPU inductor's C++ build
costs minutes and the step is bound by its matmuls, so "auto" leaves it eager there. Behind
compiled layers the attention must hand cuDNN a contiguous output gradient
(contiguous_grad.py).
Called by megatron_policy.configured_model.
"""

from __future__ import annotations

from typing import Any


def should_compile(setting: str, model: Any) -> bool:
    """Whether `compile_layers` = `setting` ("auto", "on", "off") compiles `model`'s layers."""
    if setting == "auto":
        return bool(next(model.parameters()).is_cuda)
    return setting == "on"


def compile_layers(model: Any, backend: str = "inductor") -> int:
    """Compile each transformer layer of `model` in place (megatron's `decoder.layers`; a
    pipeline stage compiles its own); returns how many were compiled."""
    decoder = getattr(model, "decoder", None)
    layers = list(getattr(decoder, "layers", None) or [])
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
