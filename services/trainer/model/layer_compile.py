"""torch.compile of the transformer layers, for the GPU path.

Between its matmuls a megatron-core layer runs dozens of small kernels (norms, residual adds,
SwiGLU, the RoPE rotation), and on a GPU its Python (the linear wrappers, the layer's own
bookkeeping) takes longer to issue a small model's forward than the GPU takes to run it.
Compiling each `TransformerLayer` with inductor fuses that elementwise work and runs the
layer's graphs without the Python in between. A padded row's layer is one graph. A packed
row's attention and its RoPE tables run outside the graphs as they are (`thd_causal`,
`rope._kept_tables`: their Python depends on the row's layout), so a packed layer compiles
into the pieces around them, once, not once per layout; every layer of a model shares the
same compiled code (parameters are graph inputs, not guards), and a new micro-batch shape
compiles once more, then shapes are treated as dynamic. Traced, that Python had split a layer
per sequence and recompiled it for each new layout until dynamo gave up, and megatron's
warning about a missing tp_group split every layer at its row-parallel linears: a
mixed-length step of a Qwen2-0.5B shape took 0.74 s compiled against 0.55 s eager, now
0.48 s (tests/unit/trainer/model/test_layer_compile.py counts the graphs).

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


def _quiet_default_tp_group() -> None:
    """megatron's RowParallelLinear hands its linear function `tp_group=None`, and the lookup
    of the default group warns about it on every call (on rank 0). dynamo cannot trace the
    warning: it split each compiled layer at every row-parallel linear. The same lookup
    without the warning, for megatron's linear layers (idempotent)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    original = layers.get_tensor_model_parallel_group_if_none
    if getattr(original, "quiet", False):
        return

    def lookup(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
        if tp_group is None and parallel_state.is_initialized():
            if is_expert:
                return parallel_state.get_expert_tensor_parallel_group(
                    check_initialized=check_initialized)  # fmt: skip
            return parallel_state.get_tensor_model_parallel_group(
                check_initialized=check_initialized)  # fmt: skip
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    lookup.quiet = True  # type: ignore[attr-defined]
    layers.get_tensor_model_parallel_group_if_none = lookup


#: Compiled versions dynamo keeps of one function before it runs it eagerly for good. All
#: layers share one code object, and a trainer's layer needs a version per kind of input:
#: padded and packed rows, a first static shape then dynamic ones, with and without grad
#: (the old policy's forward, recompute's no-grad pass), recompute's backward pass under
#: checkpoint's function mode, strides. dynamo's default of 8 was used up by the bench's five
#: cases, after which a packed step of a Qwen2-1.5B shape ran eagerly: 1.59 s against 1.29 s.
RECOMPILE_LIMIT = 64


def _allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(int(getattr(config, name)), limit))


def compile_layers(model: Any, backend: str = "inductor") -> int:
    """Compile each transformer layer of `model` in place (megatron's `decoder.layers`; a
    pipeline stage compiles its own); returns how many were compiled."""
    _quiet_default_tp_group()
    _allow_recompiles()
    decoder = getattr(model, "decoder", None)
    layers = list(getattr(decoder, "layers", None) or [])
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
