"""Run megatron-core without CUDA: the one place that redirects its torch.cuda assumptions.

megatron-core reads and sets CUDA RNG state (the model-parallel RNG tracker), asks for
`torch.cuda.current_device()` when placing rotary and attention buffers, and its DDP and
distributed optimizer create tensors on `cuda` and check `param.type()` for CUDA type names.
`apply_cpu_shim()` points the first two at their CPU equivalents and installs a torch function
mode (`CudaToCpuMode`) that maps CUDA devices to the CPU for the rest. Torch function modes are
per thread: call `apply_cpu_shim()` again in any other thread that runs megatron code (each
call is cheap and idempotent). It does nothing when CUDA is available, so the GPU path runs
megatron-core unchanged.

Called by services/trainer/parallel/parallel.py before any megatron module builds tensors.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_applied = False
_thread_state = threading.local()
_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """A torch function mode that turns every request for a CUDA device into the CPU.

    `Tensor.cuda()` returns the tensor itself and `Tensor.type()` reports the CUDA type name,
    which is what megatron's optimizers check before they accept a parameter.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):  # no pinned-memory allocator without an accelerator
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:  # new_empty/new_zeros take sizes, not devices, positionally
            args = tuple(_CPU if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


def _cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _seed_cpu(seed: int) -> None:
    # torch.manual_seed would call torch.cuda.manual_seed_all again.
    torch.default_generator.manual_seed(int(seed))


def apply_cpu_shim() -> bool:
    """Shim megatron-core for the CPU when CUDA is absent; idempotent. Returns whether active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not getattr(_thread_state, "in_mode", False):
        # Entered for good: megatron creates CUDA tensors at arbitrary points of setup and step.
        CudaToCpuMode().__enter__()
        _thread_state.in_mode = True
    if _applied:
        return True
    from megatron.core.tensor_parallel import random as mpu_random

    mpu_random._get_cuda_rng_state = _cpu_rng_state
    mpu_random._set_cuda_rng_state = _set_cpu_rng_state
    torch.cuda.get_rng_state = _cpu_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = _set_cpu_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = _seed_cpu  # type: ignore[assignment]
    torch.cuda.manual_seed_all = _seed_cpu  # type: ignore[assignment]
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    _applied = True
    return True


def cpu_shim_active() -> bool:
    """Whether `apply_cpu_shim()` has redirected megatron-core to the CPU in this process."""
    return _applied
